"""Hadoop's local file system without child processes: when a Spark session uses it, and how it is built."""

from __future__ import annotations

import dataclasses
import zipfile
from pathlib import Path

import pytest

from iotmon import class_archive, local_fs
from iotmon.config import Settings


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    return Settings(home=tmp_path / "home")


def test_a_local_session_uses_the_jar_once_setup_built_it(settings: Settings) -> None:
    assert local_fs.spark_options(settings) == {}  # not built: Hadoop's own file systems
    jar = local_fs.jar_path(settings)
    jar.parent.mkdir(parents=True)
    jar.write_bytes(b"")
    options = local_fs.spark_options(settings)
    assert options["spark.driver.extraClassPath"] == str(jar)
    assert options["spark.hadoop.fs.file.impl"] == local_fs.FILE_SYSTEM
    assert options["spark.hadoop.fs.AbstractFileSystem.file.impl"] == local_fs.ABSTRACT_FILE_SYSTEM


def test_a_cluster_keeps_hadoops_own_file_systems(settings: Settings) -> None:
    """Its executors would not have the jar."""
    jar = local_fs.jar_path(settings)
    jar.parent.mkdir(parents=True)
    jar.write_bytes(b"")
    assert local_fs.spark_options(dataclasses.replace(settings, spark_master="spark://cluster:7077")) == {}


def test_the_class_archive_is_one_of_the_class_path_it_was_built_for(settings: Settings) -> None:
    """The jar goes first on the class path, and the JVM maps an archive only for the class path that wrote it."""
    before = class_archive.archive_path(settings)
    jar = local_fs.jar_path(settings)
    jar.parent.mkdir(parents=True)
    jar.write_bytes(b"")
    assert class_archive.archive_path(settings) != before


def test_without_a_compiler_setup_says_so_and_spark_goes_on_without(
    settings: Settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    jre = tmp_path / "jre"
    (jre / "bin").mkdir(parents=True)
    monkeypatch.setenv("JAVA_HOME", str(jre))
    assert local_fs.build(settings) is None
    local_fs.set_up(settings)
    assert "this Java has no compiler (javac)" in capsys.readouterr().err
    assert local_fs.spark_options(settings) == {}


def test_setup_compiles_the_classes_once(settings: Settings, capsys: pytest.CaptureFixture[str]) -> None:
    jar, seconds = local_fs.build(settings) or (None, 0.0)
    assert jar == local_fs.jar_path(settings) and seconds > 0
    with zipfile.ZipFile(jar) as archive:
        names = set(archive.namelist())
    raw = "iotmon.hadoop.RawLocalFileSystemWithoutProcesses"
    for class_name in (local_fs.FILE_SYSTEM, local_fs.ABSTRACT_FILE_SYSTEM, raw):
        assert class_name.replace(".", "/") + ".class" in names
    assert local_fs.build(settings) == (jar, 0.0)  # there already
    local_fs.set_up(settings)
    assert f"local file system: {jar}" in capsys.readouterr().out


def test_a_session_in_a_cache_setup_did_not_prepare_builds_the_jar_first(
    settings: Settings, capsys: pytest.CaptureFixture[str]
) -> None:
    """A new IOTMON_HOME runs on the same file system as `make setup`'s: the jar is built on first use, once."""
    assert local_fs.spark_options(settings) == {}
    local_fs.ensure(settings)
    jar = local_fs.jar_path(settings)
    assert local_fs.spark_options(settings)["spark.driver.extraClassPath"] == str(jar)
    assert f"local file system: {jar}" in capsys.readouterr().err
    local_fs.ensure(settings)  # there already: nothing to build, nothing said
    assert capsys.readouterr().err == ""


def test_a_cluster_session_or_a_failed_build_is_not_tried_again(
    settings: Settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    local_fs.ensure(dataclasses.replace(settings, spark_master="spark://cluster:7077"))
    assert not local_fs.jar_path(settings).exists() and capsys.readouterr().err == ""
    jre = tmp_path / "jre"
    (jre / "bin").mkdir(parents=True)
    monkeypatch.setenv("JAVA_HOME", str(jre))
    local_fs.ensure(settings)
    assert "this Java has no compiler (javac)" in capsys.readouterr().err
    local_fs.ensure(settings)  # said once a process, not at every session
    assert capsys.readouterr().err == ""
