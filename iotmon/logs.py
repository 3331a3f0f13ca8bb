"""One logging setup: the console carries the project's own lines, the libraries' go to ``$IOTMON_HOME/logs``.

The project speaks to its user with plain lines on stdout and stderr (addresses, progress, reports), each
through ``say``: several threads speak at once (the supervisor's drain, the demo's wind-down, the
reconciliation's comparisons), and a line must reach the console whole. Spark's
JVM, its Python workers, py4j, the Kafka client, MLflow, Flask and uvicorn all log too, and on a console
their lines bury the project's. Each command therefore writes them to a file of its own,
``$IOTMON_HOME/logs/<command>.log``:

- Python's ``logging`` (and ``warnings``) goes to that file, at INFO;
- Spark's JVM is started with its stdout and stderr on that file and a log4j2 configuration of the project
  (WARN; the warnings that only say the project works as designed, at ERROR). The JVM's Python workers
  inherit the same file, banners included;
- servers the project starts (the MLflow UI) get the file as their stdout and stderr.

``IOTMON_LOG_LEVEL`` (``--verbose`` sets INFO) puts all of it back on the console, at that level.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TextIO

from iotmon.config import Settings

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
SPARK_WARNINGS_OF_INTENDED_BEHAVIOUR = (
    # transformWithState warns for every key seen the first time ("Value state ... doesn't contain a value").
    "org.apache.spark.sql.execution.python.streaming.TransformWithStateInPySparkStateServer",
    # The fair scheduler warns once per pool it makes with the default weight, where none was configured.
    "org.apache.spark.scheduler.FairSchedulableBuilder",
)
_LOG4J_LEVELS = {"DEBUG": "debug", "INFO": "info", "WARNING": "warn", "ERROR": "error"}
_process_log = "iotmon"
"""The name of this process's log file, as ``setup`` chose it (the command's)."""
_console = threading.Lock()


def say(text: str, out: TextIO | None = None) -> None:
    """``text`` as a console line on ``out`` (stdout unless given), whole: its text and newline in one write,
    one thread's line after another's, flushed at once. ``print`` writes the text and the newline apart, and two
    threads' lines ran together."""
    stream = sys.stdout if out is None else out
    with _console:
        stream.write(f"{text}\n")
        stream.flush()


def log_dir(settings: Settings) -> Path:
    return (settings.home / "logs").absolute()


def log_file(settings: Settings, name: str) -> Path:
    """Where the libraries of the command ``name`` log (``iotmon <name>``)."""
    return log_dir(settings) / f"{name}.log"


def on_console(settings: Settings) -> bool:
    """Whether library lines go to the console (``IOTMON_LOG_LEVEL`` set) instead of only to the log file."""
    return bool(settings.log_level)


def setup(settings: Settings, name: str) -> Path:
    """Route Python logging and warnings of this process to its log file (and the console when verbose)."""
    global _process_log
    _process_log = name
    path = log_file(settings, name)
    handlers: list[logging.Handler] = []
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handlers.append(logging.FileHandler(path))
    except OSError:  # an unwritable home is reported by the command that needs it, in its own words
        pass
    if on_console(settings):
        handlers.append(logging.StreamHandler(sys.stderr))
    # MLflow otherwise gives its loggers a console handler of their own at import, wherever that happens.
    os.environ.setdefault("MLFLOW_CONFIGURE_LOGGING", "false")
    level = settings.log_level or "INFO"
    logging.basicConfig(level=level, format=LOG_FORMAT, handlers=handlers or [logging.NullHandler()], force=True)
    logging.captureWarnings(True)
    # Libraries that configure their own console output when imported: theirs would bypass the root's.
    for library in ("mlflow", "py4j", "werkzeug", "dash", "alembic", "urllib3"):
        logger = logging.getLogger(library)
        logger.handlers.clear()
        logger.propagate = True
    if settings.log_level != "DEBUG":  # py4j says INFO for every call from the JVM (each progress event)
        logging.getLogger("py4j").setLevel(logging.WARNING)
    return path


def spark_log_config(settings: Settings) -> Path:
    """A log4j2 configuration for Spark's JVM: everything to its stderr (the command's log file), at WARN
    or ``IOTMON_LOG_LEVEL``, the warnings of intended behaviour at ERROR."""
    level = _LOG4J_LEVELS.get(settings.log_level, "warn")
    quiet = "".join(
        f"logger.quiet{i}.name = {name}\nlogger.quiet{i}.level = error\n"
        for i, name in enumerate(SPARK_WARNINGS_OF_INTENDED_BEHAVIOUR)
    )
    text = (
        f"rootLogger.level = {level}\n"
        "rootLogger.appenderRef.stderr.ref = stderr\n"
        "appender.console.type = Console\n"
        "appender.console.name = stderr\n"
        "appender.console.target = SYSTEM_ERR\n"
        "appender.console.layout.type = PatternLayout\n"
        "appender.console.layout.pattern = %d{yyyy-MM-dd HH:mm:ss} %p %c{1}: %m%n%ex\n"
        f"{quiet}"
    )
    path = (settings.home / "run" / "spark-log4j2.properties").absolute()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


@contextmanager
def output_to_log(settings: Settings) -> Iterator[Path | None]:
    """While inside, this process's stdout and stderr are its log file, so a process started meanwhile (Spark's
    JVM) keeps the file as its own output. Nothing changes when library lines belong on the console."""
    if on_console(settings):
        yield None
        return
    path = log_file(settings, _process_log)
    path.parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with path.open("ab") as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
    try:
        yield path
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        os.close(saved[0])
        os.close(saved[1])
