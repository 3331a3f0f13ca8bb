"""The class archive ``iotmon setup`` (and so ``make test``) builds is mapped by the Spark JVM the project starts."""

from __future__ import annotations

from pathlib import Path

import pytest
from pyspark.sql import SparkSession

from iotmon import class_archive
from iotmon.config import Settings

pytestmark = pytest.mark.integration


def test_the_session_jvm_maps_the_archive_setup_built(spark: SparkSession, base_settings: Settings) -> None:
    path = class_archive.archive_path(base_settings)
    assert path is not None and path.exists(), f"no class archive at {path}: run `make setup` (`iotmon setup`)"
    pid = spark.sparkContext._jvm.java.lang.ProcessHandle.current().pid()  # type: ignore[union-attr]
    # A JVM that found the archive stale (another JDK, other jars) would start without it: not mapped.
    assert str(path) in Path(f"/proc/{pid}/maps").read_text()
