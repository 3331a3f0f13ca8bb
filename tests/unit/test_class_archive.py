"""The JVM's class archive: where it is kept, and when a Spark start maps it."""

from __future__ import annotations

from pathlib import Path

import pytest

from iotmon import class_archive
from iotmon.config import Settings
from iotmon.spark import GARBAGE_COLLECTOR, driver_java_options


@pytest.fixture
def jdk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    home = tmp_path / "jdk"
    home.mkdir()
    (home / "release").write_text('JAVA_VERSION="17.0.15"\n')
    monkeypatch.setenv("JAVA_HOME", str(home))
    return home


def test_an_archive_is_mapped_once_setup_built_it(jdk: Path, tmp_path: Path) -> None:
    settings = Settings(home=tmp_path / "home")
    path = class_archive.archive_path(settings)
    assert path is not None and path.parent == settings.cache / "jvm"
    assert class_archive.java_options(settings) == ""  # not built: Spark starts as it would without
    assert "SharedArchiveFile" not in driver_java_options(settings)
    path.parent.mkdir(parents=True)
    path.write_bytes(b"")
    assert class_archive.java_options(settings) == f"-XX:SharedArchiveFile={path}"
    assert driver_java_options(settings).split()[1] == f"-XX:SharedArchiveFile={path}"
    assert class_archive.build(settings) == (path, 0.0)  # there already: nothing to do


@pytest.mark.parametrize("own", ["-Xshare:off", "-XX:SharedArchiveFile=/elsewhere.jsa", "-XX:ArchiveClassesAtExit=x"])
def test_an_operator_managing_class_sharing_keeps_the_flags(jdk: Path, tmp_path: Path, own: str) -> None:
    settings = Settings(home=tmp_path / "home", spark_driver_java_options=own)
    path = class_archive.archive_path(settings)
    assert path is not None
    path.parent.mkdir(parents=True)
    path.write_bytes(b"")
    assert class_archive.java_options(settings) == ""
    assert driver_java_options(settings).endswith(f"properties {GARBAGE_COLLECTOR} {own}")


def test_another_jdk_gets_an_archive_of_its_own(jdk: Path, tmp_path: Path) -> None:
    settings = Settings(home=tmp_path / "home")
    before = class_archive.archive_path(settings)
    (jdk / "release").write_text('JAVA_VERSION="21.0.5"\n')
    after = class_archive.archive_path(settings)
    assert before is not None and after is not None and before != after
