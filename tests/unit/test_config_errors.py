"""A wrong setting ends a command in seconds with one line naming the IOTMON_* variable, exit 2, no trace.

The commands run as the user runs them, ``python -m iotmon.cli`` in a child process, with no broker and no
Spark: every check here happens before either would start.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from iotmon.cli import EXIT_ERROR, main
from tests.support import PROJECT_ROOT, free_port


def _env(home: Path, **settings: str) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if not key.startswith("IOTMON_")}
    env.update({"IOTMON_HOME": str(home), "IOTMON_CACHE_DIR": str(PROJECT_ROOT / "var" / "cache")})
    env.update({f"IOTMON_{name}": value for name, value in settings.items()})
    return env


def _start(args: list[str], env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "iotmon.cli", *args],
        cwd=PROJECT_ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _one_line_error(process: subprocess.Popen, timeout: float = 300) -> str:
    """The single line a failed command printed on stderr, after checking it failed as a config error should."""
    out, err = process.communicate(timeout=timeout)
    assert process.returncode == EXIT_ERROR, (process.returncode, out, err)
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


@pytest.fixture
def a_file(tmp_path: Path) -> Path:
    """A regular file: nothing can be created under it, whoever runs the test (root included)."""
    path = tmp_path / "not-a-directory"
    path.write_text("")
    return path


def test_an_unreachable_broker_is_reported_fast_by_stream_simulate_and_verify(tmp_path: Path) -> None:
    closed = f"127.0.0.1:{free_port()}"
    lake = tmp_path / "lake"
    for table in ("bronze", "quarantine"):  # verify looks for the tables before it asks the broker
        (lake / table / "_delta_log").mkdir(parents=True)
    env = _env(tmp_path, KAFKA_BOOTSTRAP=closed)
    commands = [["stream", "--until-idle"], ["simulate", "--events", "10", "--quiet"], ["verify"]]
    running = [_start(args, env) for args in commands]  # in parallel: each waits out the broker's timeout
    for args, process in zip(commands, running, strict=True):
        line = _one_line_error(process)
        assert line.startswith(f"iotmon {args[0]}: error: Kafka at {closed} did not answer"), line
        assert "IOTMON_KAFKA_BOOTSTRAP" in line


@pytest.mark.parametrize(
    ("command", "setting"),
    [
        (["stream", "--until-idle"], "LAKE"),
        (["stream", "--until-idle"], "CHECKPOINTS"),
        (["stream", "--until-idle"], "HOME"),
        (["simulate", "--events", "10", "--quiet"], "LAKE"),
        (["simulate", "--events", "10", "--quiet"], "HOME"),
        (["train"], "HOME"),
    ],
)
def test_an_unwritable_location_names_its_setting(tmp_path: Path, a_file: Path, command: list[str], setting: str):
    location = a_file / "below"
    env = _env(tmp_path, KAFKA_BOOTSTRAP=f"127.0.0.1:{free_port()}", **{setting: str(location)})
    line = _one_line_error(_start(command, env))
    assert line.startswith(f"iotmon {command[0]}: error: IOTMON_{setting}={str(location)!r} is not usable"), line
    assert "cannot write" in line


def test_a_lake_defaulting_under_an_unwritable_home_names_home(tmp_path: Path, a_file: Path) -> None:
    line = _one_line_error(_start(["stream", "--until-idle"], _env(a_file)))
    assert f"IOTMON_HOME={str(a_file)!r} is not usable: cannot write the lake at {a_file}/lake" in line


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("IOTMON_TOPIC_PARTITIONS", "0"),  # positive integers
        ("IOTMON_MAX_PAYLOAD_BYTES", "64k"),
        ("IOTMON_QUERY_RESTARTS", "-1"),  # integers of 0 or more
        ("IOTMON_QUERY_RESTARTS", "often"),
        ("IOTMON_MAX_OFFSETS_PER_TRIGGER", "-5"),  # optional positive integers
        ("IOTMON_DASHBOARD_PORT", "http"),  # ports
        ("IOTMON_KAFKA_CONTROLLER_PORT", "99999"),
        ("IOTMON_SPARK_UI", "maybe"),  # booleans
        ("IOTMON_ANOMALY_CONTAMINATION", "5%"),  # fractions
        ("IOTMON_LOW_BATTERY", "nan"),  # percentages
        ("IOTMON_LOW_BATTERY", "150"),
        ("IOTMON_TRIGGER_INTERVAL", "5"),  # intervals
        ("IOTMON_WATERMARK", "-2 minutes"),
        ("IOTMON_IDLE_TICK_AFTER", "５ seconds"),
        ("IOTMON_WINDOW", "0 minutes"),  # intervals above zero
        ("IOTMON_SLIDE", "0 seconds"),
        ("IOTMON_SPARK_DRIVER_MEMORY", "lots"),  # memory sizes
        ("IOTMON_SPARK_DRIVER_MEMORY", "3 GB"),
        ("IOTMON_KAFKA_HEAP", "-512m"),
        ("IOTMON_MIN_EVENT_TIME", "the dawn of time"),  # ISO-8601 times
        ("IOTMON_MIN_EVENT_TIME", "2000-13-01T00:00:00Z"),
        ("IOTMON_MIN_EVENT_TIME", "946684800"),
        ("IOTMON_KAFKA_BOOTSTRAP", "localhost"),  # host:port lists
        ("IOTMON_KAFKA_BOOTSTRAP", "a:9092,b"),
        ("IOTMON_TOPIC", "my readings"),  # topic names
    ],
)
def test_a_bad_value_of_every_kind_names_the_variable(
    variable: str, value: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    for name in [name for name in os.environ if name.startswith("IOTMON_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("IOTMON_HOME", str(tmp_path))
    monkeypatch.setenv(variable, value)
    assert main(["config"]) == EXIT_ERROR
    err = capsys.readouterr().err
    assert err.startswith(f"iotmon config: error: {variable}={value!r} is not valid: expected ")
    assert len(err.strip().splitlines()) == 1


def test_a_bad_value_in_a_child_process_is_one_line_too(tmp_path: Path) -> None:
    line = _one_line_error(_start(["stream"], _env(tmp_path, QUERY_RESTARTS="-1")))
    assert line == "iotmon stream: error: IOTMON_QUERY_RESTARTS='-1' is not valid: expected an integer of 0 or more"
