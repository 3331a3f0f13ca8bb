"""One logging setup (``iotmon.logs``): library lines to the command's log file, the console kept for the
project's own lines unless ``IOTMON_LOG_LEVEL`` asks for more."""

from __future__ import annotations

import dataclasses
import logging
import os
import subprocess
import sys
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest

from iotmon import logs
from iotmon.config import Settings


@pytest.fixture
def restore_logging() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    logging.captureWarnings(False)  # an earlier in-process `main()` captured them already; start afresh
    yield
    logging.basicConfig(handlers=handlers, level=level, force=True)
    logging.captureWarnings(False)


def test_library_lines_and_warnings_go_to_the_command_log_not_the_console(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], restore_logging: None
) -> None:
    settings = Settings(home=tmp_path)
    path = logs.setup(settings, "demo")
    logging.getLogger("py4j.clientserver").warning("Error while sending or receiving")
    with warnings.catch_warnings():
        warnings.simplefilter("always")  # whatever filters the test run has set
        warnings.warn("starlette.middleware.wsgi is deprecated", DeprecationWarning, stacklevel=1)
    assert path == tmp_path / "logs" / "demo.log"
    text = path.read_text()
    assert "py4j.clientserver: Error while sending or receiving" in text
    assert "starlette.middleware.wsgi is deprecated" in text
    captured = capsys.readouterr()
    assert captured.out == captured.err == ""


def test_a_log_level_puts_library_lines_on_the_console_too(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], restore_logging: None
) -> None:
    settings = dataclasses.replace(Settings(home=tmp_path), log_level="INFO")
    logs.setup(settings, "stream")
    logging.getLogger("mlflow").info("Registered model")
    logging.getLogger("mlflow").debug("below the level")
    assert "mlflow: Registered model" in capsys.readouterr().err
    assert "below the level" not in (tmp_path / "logs" / "stream.log").read_text()


def test_spark_logs_at_warn_and_keeps_intended_warnings_at_error(tmp_path: Path) -> None:
    text = logs.spark_log_config(Settings(home=tmp_path)).read_text()
    assert "rootLogger.level = warn" in text
    assert "appender.console.target = SYSTEM_ERR" in text
    for name in logs.SPARK_WARNINGS_OF_INTENDED_BEHAVIOUR:
        assert f".name = {name}\n" in text
    verbose = dataclasses.replace(Settings(home=tmp_path), log_level="DEBUG")
    assert "rootLogger.level = debug" in logs.spark_log_config(verbose).read_text()


def test_the_driver_jvm_gets_the_log_configuration_and_collector_then_the_operator_s_own_flags(tmp_path: Path) -> None:
    from iotmon.spark import GARBAGE_COLLECTOR, driver_java_options

    log_config = f"-Dlog4j2.configurationFile={logs.spark_log_config(Settings(home=tmp_path))}"
    assert driver_java_options(Settings(home=tmp_path)) == f"{log_config} {GARBAGE_COLLECTOR}"
    jit = Settings(home=tmp_path, spark_driver_java_options="-XX:TieredStopAtLevel=1")
    assert driver_java_options(jit) == f"{log_config} {GARBAGE_COLLECTOR} -XX:TieredStopAtLevel=1"
    # An operator naming a collector gets it alone: the JVM refuses to start with two.
    tuned = Settings(home=tmp_path, spark_driver_java_options="-XX:+UseSerialGC -XX:TieredStopAtLevel=1")
    assert driver_java_options(tuned) == f"{log_config} -XX:+UseSerialGC -XX:TieredStopAtLevel=1"


def test_a_process_started_inside_output_to_log_writes_to_the_file_and_the_console_comes_back(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], restore_logging: None
) -> None:
    settings = Settings(home=tmp_path)
    logs.setup(settings, "train")
    with logs.output_to_log(settings) as path:
        child = subprocess.Popen(
            [sys.executable, "-c", "import sys; print('jvm banner'); print('jvm warn', file=sys.stderr)"]
        )
    child.wait()
    os.write(1, b"project line\n")
    assert path is not None
    assert "jvm banner" in path.read_text() and "jvm warn" in path.read_text()
    captured = capfd.readouterr()
    assert "project line" in captured.out
    assert "jvm" not in captured.out + captured.err


def test_a_console_line_is_one_write_whatever_thread_says_it(capsys: pytest.CaptureFixture[str]) -> None:
    """Threads speak at once (the drain, the demo's wind-down, the reconciliation): a line written in two
    parts, as ``print`` writes a text and its newline, can have another thread's line between them."""
    writes: list[str] = []

    class Console:
        def write(self, text: str) -> int:
            writes.append(text)
            return len(text)

        def flush(self) -> None:
            pass

    speakers = [
        threading.Thread(target=lambda n=n: [logs.say(f"thread {n} line {i}", Console()) for i in range(200)])
        for n in range(4)
    ]
    for speaker in speakers:
        speaker.start()
    for speaker in speakers:
        speaker.join()
    assert sorted(writes) == sorted(f"thread {n} line {i}\n" for n in range(4) for i in range(200))
    logs.say("to the console")  # stdout as it is when said: the test's capture here
    assert capsys.readouterr().out == "to the console\n"
