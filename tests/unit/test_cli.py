"""Mistakes at the command line get a clear message naming what to fix, never a stack trace."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
from pathlib import Path

import pytest

from iotmon.cli import EXIT_ERROR, main, reconciliation_progress, remember_interrupts, stop_on_signals


@pytest.fixture(autouse=True)
def local_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    for variable in [v for v in os.environ if v.startswith("IOTMON_")]:
        monkeypatch.delenv(variable)
    monkeypatch.setenv("IOTMON_HOME", str(tmp_path))
    return tmp_path


def test_a_bad_setting_names_the_variable(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setenv("IOTMON_TOPIC_PARTITIONS", "lots")
    assert main(["config"]) == EXIT_ERROR
    err = capsys.readouterr().err
    assert "IOTMON_TOPIC_PARTITIONS='lots' is not valid" in err
    assert "Traceback" not in err


def test_an_interrupt_while_starting_is_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    # The parser imports the stages for their defaults (pyspark.ml among them: seconds); a supervisor stopping a
    # command that has just started (`iotmon chaos` its trainer) interrupts it there.
    def interrupted() -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr("iotmon.cli.build_parser", interrupted)
    assert main(["train"]) == 130
    err = capsys.readouterr().err
    assert err == "iotmon: interrupted\n"


def test_simulate_needs_a_stopping_rule(capsys: pytest.CaptureFixture) -> None:
    assert main(["simulate"]) == EXIT_ERROR
    assert "backlog mode needs events or duration" in capsys.readouterr().err


def test_simulate_rejects_impossible_fractions(capsys: pytest.CaptureFixture) -> None:
    assert main(["simulate", "--events", "10", "--anomaly-fraction", "1.5"]) == EXIT_ERROR
    err = capsys.readouterr().err
    assert "anomaly fraction must be in [0, 1)" in err and "Traceback" not in err


def test_verify_with_a_missing_truth_file(capsys: pytest.CaptureFixture) -> None:
    assert main(["verify", "--truth", "nowhere.parquet"]) == EXIT_ERROR
    assert "ground-truth file not found: nowhere.parquet" in capsys.readouterr().err


def test_kafka_status_when_stopped(capsys: pytest.CaptureFixture, local_home: Path) -> None:
    assert main(["kafka", "status"]) == 3
    assert "stopped" in capsys.readouterr().out


def test_reset_removes_lake_and_checkpoints_together(local_home: Path) -> None:
    for folder in ("lake/bronze", "checkpoints/bronze", "truth"):
        (local_home / folder).mkdir(parents=True)
    assert main(["reset"]) == 0
    assert not (local_home / "lake").exists() and not (local_home / "checkpoints").exists()


def test_verify_before_any_stream_says_what_to_run(
    spark, base_settings, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.setenv("IOTMON_CACHE_DIR", str(base_settings.cache))
    assert main(["verify"]) == EXIT_ERROR
    assert "no bronze table at" in capsys.readouterr().err


def test_a_bad_sql_statement_is_one_clear_line(
    spark, base_settings, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.setenv("IOTMON_CACHE_DIR", str(base_settings.cache))
    assert main(["sql", "SELECT no_such_column"]) == EXIT_ERROR
    err = capsys.readouterr().err
    assert err.startswith("error: [UNRESOLVED_COLUMN") and len(err.strip().splitlines()) == 1


def test_chaos_refuses_a_broker_it_cannot_restart(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.setenv("IOTMON_KAFKA_BOOTSTRAP", "kafka.example.com:9092")
    assert main(["chaos"]) == EXIT_ERROR
    err = capsys.readouterr().err
    assert "is not a broker chaos can restart" in err and "Traceback" not in err


def test_chaos_refuses_a_port_someone_else_listens_on(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        monkeypatch.setenv("IOTMON_KAFKA_BOOTSTRAP", f"127.0.0.1:{other.getsockname()[1]}")
        assert main(["chaos"]) == EXIT_ERROR
    assert "something chaos did not start listens on 127.0.0.1" in capsys.readouterr().err


def test_chaos_checks_its_options(capsys: pytest.CaptureFixture) -> None:
    assert main(["chaos", "--kills", "2", "--broker-restarts", "3"]) == EXIT_ERROR
    assert "--broker-restarts must be between 0 and --kills" in capsys.readouterr().err
    assert main(["chaos", "--kill-in", "ingest,silverr"]) == EXIT_ERROR
    assert "--kill-in: no query named silverr" in capsys.readouterr().err
    assert main(["chaos", "--kills", "1", "--broker-restarts", "0", "--kill-in", "ingest,anomalies"]) == EXIT_ERROR
    assert "--kill-in names more queries than --kills allows" in capsys.readouterr().err


def test_demo_refuses_a_malformed_interval_before_it_deletes_or_starts_anything(
    capsys: pytest.CaptureFixture, local_home: Path
) -> None:
    (local_home / "lake" / "bronze").mkdir(parents=True)
    with pytest.raises(SystemExit) as exit_:
        main(["demo", "--fresh", "--retrain-every", "often"])
    assert exit_.value.code == EXIT_ERROR
    assert "expected '<number> seconds|minutes|hours', not 'often'" in capsys.readouterr().err
    assert (local_home / "lake" / "bronze").is_dir()  # --fresh deleted nothing


def test_an_unexpected_error_is_one_line_naming_the_log_with_the_traceback(
    local_home: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    def broken(*_: object) -> int:
        raise RuntimeError("the disk went away\nand a second line")

    monkeypatch.setattr("iotmon.cli.cmd_config", broken)
    assert main(["config"]) == EXIT_ERROR
    err = capsys.readouterr().err
    log = local_home / "logs" / "config.log"
    assert err == f"iotmon config: unexpected error: the disk went away; details in {log}\n"
    assert "Traceback" in log.read_text() and "RuntimeError: the disk went away" in log.read_text()


def test_verbose_asks_this_process_and_its_children_for_library_lines(capsys: pytest.CaptureFixture) -> None:
    try:
        assert main(["--verbose", "config"]) == 0
        assert os.environ["IOTMON_LOG_LEVEL"] == "INFO"
        assert "IOTMON_LOG_LEVEL" in capsys.readouterr().out
    finally:
        os.environ.pop("IOTMON_LOG_LEVEL", None)


def _swallowed_interrupt() -> None:
    """A SIGINT landing where a library catches everything (``pyspark.ml.linalg`` around ``import scipy``)."""
    with contextlib.suppress(BaseException):
        signal.raise_signal(signal.SIGINT)  # its Python handler runs before this returns


def test_an_interrupt_a_library_swallowed_while_starting_still_stops_the_command() -> None:
    handlers = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        signal.signal(signal.SIGINT, signal.default_int_handler)  # Python's own: the interrupt is lost
        _swallowed_interrupt()
        assert not stop_on_signals().is_set()

        remember_interrupts()  # what `main` installs first
        _swallowed_interrupt()
        assert stop_on_signals().is_set()
        assert not stop_on_signals().is_set()  # honoured once: a later command in this process runs
    finally:
        for signum, handler in handlers.items():
            signal.signal(signum, handler)


def test_reconciliation_progress_lines_go_to_stderr(capsys: pytest.CaptureFixture[str]) -> None:
    """The reconciliation's comparisons report on threads: their lines go through ``iotmon.logs.say``, whole
    (tests/unit/test_logs.py), to stderr, so stdout keeps the report."""
    reconciliation_progress("silver against bronze")
    reconciliation_progress("alerts against the alert rules")
    captured = capsys.readouterr()
    assert (captured.out, captured.err) == (
        "",
        "verify: checking silver against bronze\nverify: checking alerts against the alert rules\n",
    )
