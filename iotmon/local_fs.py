"""Hadoop's local file system without child processes, for a Spark that runs on this machine.

Without Hadoop's native library, which Maven Central does not ship, Hadoop's local file system runs a ``chmod``
process for every file it creates and a ``readlink`` for the file status a ``FileContext`` rename asks for:
every Delta commit, checkpoint and state file and Parquet file of every micro-batch starts one or two
processes from the Spark JVM (docs/cost-model.md, the local file system's processes). Three small classes
(``iotmon/java/iotmon/hadoop``) do the same through the JDK, in the process; ``iotmon setup`` compiles them
once into the cache, and a local Spark session puts them first on its class path and names them Hadoop's
``file:`` file systems (a session in a cache without it builds it first, ``ensure``). A cluster's executors
would need the jar as well, so a session with a cluster master keeps Hadoop's own, as does a machine whose Java
has no compiler (a JRE): the same files, only slower.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path
from typing import TextIO

from iotmon.config import Settings
from iotmon.jars import java_home, pyspark_jars_dir
from iotmon.logs import say

SOURCES = Path(__file__).parent / "java"
FILE_SYSTEM = "iotmon.hadoop.LocalFileSystemWithoutProcesses"
"""``fs.file.impl``: what Hadoop's ``FileSystem`` API uses for ``file:`` paths."""
ABSTRACT_FILE_SYSTEM = "iotmon.hadoop.LocalFsWithoutProcesses"
"""``fs.AbstractFileSystem.file.impl``: the same for Hadoop's ``FileContext`` API (Delta's log store)."""
BUILD_TIMEOUT_S = 300.0


class LocalFileSystemError(RuntimeError):
    """The classes could not be compiled; Spark uses Hadoop's own local file system, only slower."""


def java_sources() -> list[Path]:
    return sorted(SOURCES.rglob("*.java"))


def jar_path(settings: Settings) -> Path:
    """Where the compiled classes are kept: named after the sources and the Hadoop they compile against, so a
    change of either builds anew."""
    digest = hashlib.sha256()
    for source in java_sources():
        digest.update(source.relative_to(SOURCES).as_posix().encode() + b"\0" + source.read_bytes())
    for jar in sorted(pyspark_jars_dir().glob("hadoop-client-api-*.jar")):
        digest.update(jar.name.encode())
    return settings.cache / "jvm" / f"iotmon-local-fs-{digest.hexdigest()[:12]}.jar"


def class_path(settings: Settings) -> list[str]:
    """What a Spark session of these settings puts first on its driver's class path: the compiled classes, when
    Spark runs locally and ``iotmon setup`` built them."""
    jar = jar_path(settings)
    return [str(jar)] if settings.spark_is_local and jar.exists() else []


def spark_options(settings: Settings) -> dict[str, str]:
    """The Spark settings that make a session use the file systems without processes (none when it cannot)."""
    entries = class_path(settings)
    if not entries:
        return {}
    return {
        "spark.driver.extraClassPath": os.pathsep.join(entries),
        "spark.hadoop.fs.file.impl": FILE_SYSTEM,
        "spark.hadoop.fs.AbstractFileSystem.file.impl": ABSTRACT_FILE_SYSTEM,
    }


def build(settings: Settings) -> tuple[Path, float] | None:
    """Compile the classes against Spark's Hadoop if they are missing; returns the jar and the seconds it took (0
    if it was there already), or None without a Java compiler. Jars of older sources are removed."""
    path = jar_path(settings)
    if path.exists():
        return path, 0.0
    home = java_home()
    javac = home / "bin" / "javac" if home is not None else None
    if javac is None or not javac.exists():
        return None
    started = time.monotonic()
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="local-fs-", dir=path.parent) as scratch:
        classes = Path(scratch) / "classes"
        command = [
            str(javac), "--release", "17", "-nowarn", "-d", str(classes),
            "-cp", str(pyspark_jars_dir() / "*"), *map(str, java_sources()),
        ]  # fmt: skip
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise LocalFileSystemError(f"javac took more than {BUILD_TIMEOUT_S:.0f} s") from None
        if done.returncode != 0:
            output = (done.stdout + done.stderr)[-2000:]
            raise LocalFileSystemError(f"javac ended with code {done.returncode}:\n{output}")
        partial = Path(scratch) / path.name
        with zipfile.ZipFile(partial, "w", zipfile.ZIP_DEFLATED) as jar:
            for compiled in sorted(classes.rglob("*.class")):
                jar.write(compiled, compiled.relative_to(classes).as_posix())
        partial.replace(path)
    for stale in path.parent.glob("iotmon-local-fs-*.jar"):
        if stale != path:
            stale.unlink()
    return path, time.monotonic() - started


_ATTEMPTED: set[Path] = set()
"""The jars this process has tried to build already (``ensure``): a failure is said once, not at every session."""


def ensure(settings: Settings) -> None:
    """Build the jar for a local session whose cache ``iotmon setup`` did not prepare (a new ``IOTMON_HOME`` or
    ``IOTMON_CACHE_DIR``), as Spark's jars are resolved on first use: about 2 s once, so that every local session
    runs on the same file system and a bench in a new home measures what the stream runs. Said on stderr, as
    ``iotmon setup`` says it; without a compiler Hadoop's own is used (only slower)."""
    path = jar_path(settings)
    if path.exists() or path in _ATTEMPTED or not settings.spark_is_local:
        return
    _ATTEMPTED.add(path)
    set_up(settings, sys.stderr)


def set_up(settings: Settings, out: TextIO | None = None) -> None:
    """``iotmon setup``'s part: build the jar if it is missing and say where it is. A failed build is a line on
    stderr, not a failed setup: Spark then uses Hadoop's own local file system."""
    try:
        built = build(settings)
    except LocalFileSystemError as exc:
        say(f"local file system: not built, Spark uses Hadoop's (only slower): {exc}", sys.stderr)
        return
    if built is None:
        say(
            "local file system: skipped, this Java has no compiler (javac); Spark uses Hadoop's (only slower). "
            "A JDK instead of a JRE builds it at the next `iotmon setup`",
            sys.stderr,
        )
        return
    path, seconds = built
    took = f", built in {seconds:.1f}s" if seconds else ""
    say(f"local file system: {path} (Hadoop's, without child processes{took})", out or sys.stdout)
