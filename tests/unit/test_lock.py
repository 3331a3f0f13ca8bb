"""``requirements.lock`` pins the versions the tests run with; ``pyproject.toml`` keeps the ranges a library user
gets. Nothing makes one follow the other when either is edited by hand, so this checks that they agree."""

from __future__ import annotations

import tomllib

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from tests.support import PROJECT_ROOT


def locked_pins(lock: str) -> tuple[dict[str, Version], list[str]]:
    """The lock's pins by normalised name, and every line that is not one exact pin."""
    pins: dict[str, Version] = {}
    problems = []
    for line in lock.splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        requirement = Requirement(line)
        specifiers = list(requirement.specifier)
        name = canonicalize_name(requirement.name)
        if len(specifiers) != 1 or specifiers[0].operator != "==" or "*" in specifiers[0].version:
            problems.append(f"{line}: not an exact pin")
        elif name in pins:
            problems.append(f"{line}: {name} pinned twice")
        else:
            pins[name] = Version(specifiers[0].version)
    return pins, problems


def lock_drift(pyproject: str, lock: str) -> list[str]:
    """Dependencies (main and ``dev``) that the lock leaves out or pins outside pyproject's range."""
    project = tomllib.loads(pyproject)["project"]
    pins, problems = locked_pins(lock)
    for line in (*project["dependencies"], *project["optional-dependencies"]["dev"]):
        requirement = Requirement(line)
        if requirement.marker is not None and not requirement.marker.evaluate():
            continue  # not for this platform, which is the one the lock is made for
        pinned = pins.get(canonicalize_name(requirement.name))
        if pinned is None:
            problems.append(f"{line}: not in requirements.lock")
        elif not requirement.specifier.contains(pinned, prereleases=True):
            problems.append(f"{line}: requirements.lock pins {pinned}")
    return problems


def test_the_lock_pins_every_declared_dependency_within_its_range() -> None:
    pyproject = (PROJECT_ROOT / "pyproject.toml").read_text()
    lock = (PROJECT_ROOT / "requirements.lock").read_text()
    assert lock_drift(pyproject, lock) == [], "edit pyproject.toml's ranges or run `make lock` (docs/install.md)"
    pins, _ = locked_pins(lock)
    assert {"pyspark", "mlflow", "deltalake", "dash", "pytest"} <= set(pins)


def test_drift_is_reported_per_dependency() -> None:
    pyproject = """
[project]
dependencies = ["mlflow>=3.7,<4", "Dash>=2.17", "pywin32>=300; sys_platform == 'nonesuch'"]
[project.optional-dependencies]
dev = ["pytest>=8"]
"""
    lock = """
mlflow==4.0.1
    # via iotmon
dash==4.4.1
requests>=2
charset_normalizer==3.5.2
charset-normalizer==3.5.2
"""
    assert lock_drift(pyproject, lock) == [
        "requests>=2: not an exact pin",
        "charset-normalizer==3.5.2: charset-normalizer pinned twice",
        "mlflow>=3.7,<4: requirements.lock pins 4.0.1",
        "pytest>=8: not in requirements.lock",
    ]
