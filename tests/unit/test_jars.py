from pathlib import Path

import pytest

from iotmon import jars
from iotmon.config import Settings


def test_pom_pins_coordinates_and_exclusions() -> None:
    pom = jars._pom(jars.spark_extras_bundle())
    assert f"<artifactId>delta-spark_4.2_2.13</artifactId><version>{jars.DELTA_JAR_VERSION}</version>" in pom
    assert "<artifactId>spark-sql-kafka-0-10_2.13</artifactId><version>4.2.0</version>" in pom
    assert "<exclusion><groupId>org.apache.spark</groupId>" in pom


def test_bundle_dir_changes_with_pins(tmp_path: Path) -> None:
    settings = Settings.from_env({}, home=tmp_path)
    broker = jars.kafka_broker_bundle()
    changed = jars.Bundle(broker.name, (*broker.dependencies, jars.Dependency("org.example:extra:1")))
    assert jars.bundle_dir(settings, broker) != jars.bundle_dir(settings, changed)


def test_complete_bundle_resolves_offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    settings = Settings.from_env({}, home=tmp_path)
    bundle = jars.kafka_broker_bundle()
    folder = jars.bundle_dir(settings, bundle)
    folder.mkdir(parents=True)
    (folder / jars.MANIFEST).write_text("a-1.0.jar\nb-2.0.jar\n")
    monkeypatch.setattr(jars.shutil, "which", lambda name: None)  # no Maven: must not be needed
    assert jars.resolve(settings, bundle) == [folder / "a-1.0.jar", folder / "b-2.0.jar"]


def test_missing_maven_says_what_to_install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(jars.shutil, "which", lambda name: None)
    with pytest.raises(jars.ResolutionError, match="apt-get install maven"):
        jars.resolve(Settings.from_env({}, home=tmp_path), jars.kafka_broker_bundle())


def test_jars_already_on_the_classpath_are_skipped(tmp_path: Path) -> None:
    (tmp_path / "jackson-core-2.21.2.jar").touch()
    (tmp_path / "scala-library-2.13.18.jar").touch()
    assert jars._already_present((tmp_path,)) == {"jackson-core", "scala-library"}
