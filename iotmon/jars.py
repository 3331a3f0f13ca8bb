"""Java artifacts the project needs, resolved from Maven Central once and cached in the local state.

Two bundles: the Kafka broker (run as a plain ``java -cp`` process) and Spark's extra connectors (Delta,
Kafka source). Each resolves with ``mvn dependency:copy-dependencies`` into a folder named after a hash of
its coordinates; a manifest written last marks it complete, so later starts need no network and a changed
pin resolves afresh.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from xml.sax.saxutils import escape

from iotmon.config import Settings
from iotmon.logs import say

KAFKA_VERSION = "4.2.1"
SPARK_VERSION = "4.2.0"
# The Python package is delta-spark 4.4.1; its jar is not published on Maven Central, 4.4.0 is (same API).
DELTA_JAR_VERSION = "4.4.0"
LOG4J_VERSION = "2.25.2"

MANIFEST = "jars.txt"
_JAR_NAME = re.compile(r"^(?P<artifact>.+?)-(?P<version>\d[^/]*)\.jar$")


class ResolutionError(RuntimeError):
    """Jars could not be resolved; the message says what to install or check."""


@dataclass(frozen=True)
class Dependency:
    coordinate: str
    """``group:artifact:version``."""
    exclusions: tuple[str, ...] = ()
    """``group:artifact`` patterns (``*`` allowed) left out of this dependency's transitive closure."""


@dataclass(frozen=True)
class Bundle:
    name: str
    dependencies: tuple[Dependency, ...]
    skip_artifacts_of: tuple[Path, ...] = field(default=())
    """Folders of jars already on the classpath: the same artifacts are not added twice."""


def kafka_broker_bundle() -> Bundle:
    return Bundle(
        "kafka-broker",
        (
            Dependency(f"org.apache.kafka:kafka_2.13:{KAFKA_VERSION}"),
            # Kafka ships no logging backend; without one the broker runs silently.
            Dependency(f"org.apache.logging.log4j:log4j-core:{LOG4J_VERSION}"),
            Dependency(f"org.apache.logging.log4j:log4j-slf4j2-impl:{LOG4J_VERSION}"),
            Dependency("org.slf4j:slf4j-api:2.0.17"),
        ),
    )


def java_home() -> Path | None:
    """The JDK Spark starts: ``JAVA_HOME``'s, else the one of ``java`` on the PATH (as ``spark-class`` does)."""
    if home := os.environ.get("JAVA_HOME"):
        return Path(home)
    java = shutil.which("java")
    return Path(java).resolve().parent.parent if java else None


def pyspark_jars_dir() -> Path:
    import pyspark

    return Path(pyspark.__file__).parent / "jars"


def spark_extras_bundle() -> Bundle:
    token_provider = "org.apache.spark:spark-token-provider-kafka-0-10_2.13"
    return Bundle(
        "spark-extras",
        (
            Dependency(f"io.delta:delta-spark_{SPARK_VERSION[:3]}_2.13:{DELTA_JAR_VERSION}"),
            # Maven Central has no 4.2.0 token provider; 4.0.0 has the same (delegation-token) classes.
            Dependency(f"org.apache.spark:spark-sql-kafka-0-10_2.13:{SPARK_VERSION}", (token_provider,)),
            Dependency(f"{token_provider}:4.0.0", ("*:*",)),
        ),
        skip_artifacts_of=(pyspark_jars_dir(),),
    )


def _pom(bundle: Bundle) -> str:
    deps = []
    for dep in bundle.dependencies:
        group, artifact, version = dep.coordinate.split(":")
        exclusions = "".join(
            "<exclusion><groupId>{}</groupId><artifactId>{}</artifactId></exclusion>".format(
                *map(escape, pattern.split(":"))
            )
            for pattern in dep.exclusions
        )
        deps.append(
            f"<dependency><groupId>{escape(group)}</groupId><artifactId>{escape(artifact)}</artifactId>"
            f"<version>{escape(version)}</version><exclusions>{exclusions}</exclusions></dependency>"
        )
    return (
        '<project xmlns="http://maven.apache.org/POM/4.0.0"><modelVersion>4.0.0</modelVersion>'
        f"<groupId>iotmon.bundles</groupId><artifactId>{bundle.name}</artifactId><version>1</version>"
        f"<packaging>pom</packaging><dependencies>{''.join(deps)}</dependencies></project>\n"
    )


def bundle_dir(settings: Settings, bundle: Bundle) -> Path:
    digest = hashlib.sha256(_pom(bundle).encode()).hexdigest()[:12]
    return settings.cache / "jars" / f"{bundle.name}-{digest}"


def _already_present(skip_dirs: tuple[Path, ...]) -> set[str]:
    names = set()
    for folder in skip_dirs:
        for jar in folder.glob("*.jar"):
            match = _JAR_NAME.match(jar.name)
            names.add(match["artifact"] if match else jar.stem)
    return names


def resolve(settings: Settings, bundle: Bundle) -> list[Path]:
    """Jar paths of the bundle, downloading them on first use only."""
    target = bundle_dir(settings, bundle)
    manifest = target / MANIFEST
    if manifest.exists():
        return [target / name for name in manifest.read_text().split()]
    mvn = shutil.which("mvn")
    if mvn is None:
        raise ResolutionError(
            f"Maven (`mvn`) is needed once to download the {bundle.name} jars from Maven Central. "
            "Install it (e.g. `apt-get install maven`) and run the command again."
        )
    say(f"Resolving {bundle.name} jars from Maven Central (first run only) ...", sys.stderr)
    settings.cache.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f"{bundle.name}-", dir=settings.cache))
    try:
        (staging / "pom.xml").write_text(_pom(bundle))
        maven_settings = Path(__file__).parent / "maven" / "settings.xml"
        command = [
            mvn,
            "-B",
            "-q",
            "-s",
            str(maven_settings),
            f"-Dmaven.repo.local={settings.cache / 'm2'}",
            "dependency:copy-dependencies",
            "-DincludeScope=runtime",
            f"-DoutputDirectory={staging / 'lib'}",
        ]
        result = subprocess.run(command, cwd=staging, capture_output=True, text=True)
        if result.returncode != 0:
            errors = [line for line in result.stdout.splitlines() if "ERROR" in line][:5]
            raise ResolutionError(
                f"Maven could not resolve the {bundle.name} jars:\n  "
                + "\n  ".join(errors or [result.stderr.strip()[-2000:]])
                + "\nCheck that Maven Central is reachable, then run the command again."
            )
        skip = _already_present(bundle.skip_artifacts_of)
        jars = sorted(
            jar.name
            for jar in (staging / "lib").glob("*.jar")
            if (_JAR_NAME.match(jar.name) or {"artifact": jar.stem})["artifact"] not in skip
        )
        target.mkdir(parents=True, exist_ok=True)
        for name in jars:
            shutil.copy2(staging / "lib" / name, target / name)
        manifest.write_text("\n".join(jars) + "\n")
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return [target / name for name in jars]
