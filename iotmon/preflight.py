"""Checks a command makes before it starts Spark or publishes: a wrong setting fails in seconds, naming the
``IOTMON_*`` variable to fix, instead of minutes later inside a JVM stack trace."""

from __future__ import annotations

import tempfile
from pathlib import Path

from iotmon.config import ConfigError, Settings


def local_directory(location: str) -> Path | None:
    """The local directory a lake or checkpoint location names; None for object stores (s3a://, abfss://)."""
    if location.startswith("file:"):
        return Path(location.removeprefix("file:").removeprefix("//"))
    return None if "://" in location else Path(location)


def _origin(settings: Settings, place: str) -> tuple[str, str]:
    """The variable a location comes from, and its value: its own setting, or IOTMON_HOME it defaults under."""
    own = {"lake": ("IOTMON_LAKE", settings.lake), "checkpoints": ("IOTMON_CHECKPOINTS", settings.checkpoints)}
    name, value = own.get(place, ("IOTMON_HOME", None))
    return (name, value) if value is not None else ("IOTMON_HOME", str(settings.home))


def require_writable(settings: Settings, *places: str) -> None:
    """Create each local directory of ``places`` (``lake``, ``checkpoints``, ``home``) and a file in it.

    Object-store locations are left to their client: only the store can tell whether a write will pass.
    """
    locations = {"lake": settings.lake_root, "checkpoints": settings.checkpoint_root, "home": str(settings.home)}
    for place in places:
        directory = local_directory(locations[place])
        if directory is None:
            continue
        try:
            directory.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryFile(dir=directory):
                pass
        except OSError as exc:
            name, value = _origin(settings, place)
            reason = exc.strerror or type(exc).__name__
            raise ConfigError(
                f"{name}={value!r} is not usable: cannot write the {place} at {directory} ({reason})"
            ) from None
