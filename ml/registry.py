"""MLflow at the edge: where runs and models are tracked, and the ``champion`` alias the scorer serves.

A registered version carries what serving needs besides the pipeline, as version tags: the decision
``threshold``, the ``feature_history_s`` and the ``feature_version`` (of ``ml.features``) it was trained
with, so a scorer never pairs a model with the wrong threshold, feature window or feature code. The alias
is moved only after the version exists with its tags, so ``champion`` never points at a half-registered
model.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path

from pyspark.ml import PipelineModel

from iotmon.config import Settings
from iotmon.logs import on_console
from ml.features import FEATURE_VERSION

CHAMPION = "champion"
EXPERIMENT = "iotmon-anomaly"
THRESHOLD_TAG = "threshold"
HISTORY_TAG = "feature_history_s"
FEATURES_TAG = "feature_version"
MODEL_ARTIFACT = "model"
PROMOTED_TAG = "promoted"
DECISION_TAG = "decision"
"""Tags of a trainer's run: whether it moved the champion alias (``True``/``False``), and why (not)."""

_setup_lock = threading.Lock()

MLFLOW_MODULES = (
    "mlflow",
    "mlflow.exceptions",
    "mlflow.spark",
    "mlflow.utils.autologging_utils.logging_and_warnings",
)
"""Every MLflow module the project imports (``tests/unit/test_registry.py`` keeps the list complete)."""


def import_mlflow() -> None:
    """Import MLflow now, in this thread: call it in the main thread before starting threads that may use MLflow.

    MLflow's first import is not thread-safe: its modules import each other in a circle, so two threads importing
    them at once deadlock, and Python breaks the deadlock by failing an import or handing out a half-initialised
    module (``Couldn't build proto file into descriptor pool: Depends on file 'databricks.proto'``, ``partially
    initialized module 'mlflow'``), which stays broken for the process. Once imported, imports only look it up.
    """
    for name in MLFLOW_MODULES:
        importlib.import_module(name)


@dataclass(frozen=True)
class ModelRef:
    """A registered version of the anomaly model and the serving parameters stored with it."""

    name: str
    version: int
    threshold: float
    feature_history_s: float
    run_id: str | None = None

    @property
    def uri(self) -> str:
        return f"models:/{self.name}/{self.version}"


def quiet(settings: Settings) -> contextlib.AbstractContextManager[object]:
    """MLflow's own prints off the console while in it, unless ``IOTMON_LOG_LEVEL`` asks for library lines.

    MLflow's registry prints ``Successfully registered model ...`` and ``Created version ...`` through its own
    stream, past ``logging``. Its ``disable_logging()`` alone does not hold: MLflow switches that stream back on
    whenever one of its counted "quiet" blocks ends, as importing ``mlflow.types.responses`` does during a first
    ``log_model``. Holding a count of its own keeps the stream off until the block ends."""
    from mlflow.utils.autologging_utils.logging_and_warnings import MlflowEventsAndWarningsBehaviorGlobally

    if on_console(settings):
        return contextlib.nullcontext()
    return MlflowEventsAndWarningsBehaviorGlobally(
        reroute_warnings=False, disable_event_logs=True, disable_warnings=False
    )


def tracking(settings: Settings):
    """An ``MlflowClient`` on the configured tracking and registry URI (local SQLite by default)."""
    import mlflow
    from mlflow import MlflowClient

    with _setup_lock:
        # MLflow logs a line per Alembic migration when it creates its SQLite schema; keep startup quiet.
        logging.getLogger("alembic").setLevel(logging.WARNING)
        logging.getLogger("mlflow.store.db.utils").setLevel(logging.WARNING)
        # mlflow.spark reports at INFO that a local model is "uploaded" to the local file system.
        logging.getLogger("mlflow.spark").setLevel(logging.WARNING)
        os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
        if settings.mlflow_tracking_uri is None:
            _create_local_store(settings.mlflow_database)
        mlflow.set_tracking_uri(settings.tracking_uri)
        mlflow.set_registry_uri(settings.tracking_uri)
    return MlflowClient(settings.tracking_uri, settings.tracking_uri)


def _create_local_store(database: Path) -> None:
    """Create the local SQLite store whole, or not at all.

    MLflow builds its schema in place, one Alembic migration after another, without a lock between
    processes; a process killed in the middle (the stream's scorer polls the registry, and gets SIGKILLed)
    or two processes starting together leave a half-migrated file that every later start fails on
    (``duplicate column name``). So the schema is built in a private file and linked into place in one
    step: whoever links first wins, and the others' copies are dropped.
    """
    from mlflow import MlflowClient

    if database.exists():
        return
    database.parent.mkdir(parents=True, exist_ok=True)
    for left in database.parent.glob(f".{database.name}.*.tmp*"):  # scratch copies (and journals) of killed processes
        if not _alive(int(left.name.split(".")[-2])):
            left.unlink(missing_ok=True)
    scratch = database.with_name(f".{database.name}.{os.getpid()}.tmp")
    try:
        MlflowClient(f"sqlite:///{scratch}").search_experiments(max_results=1)  # runs every migration
        with scratch.open("rb") as built:
            os.fsync(built.fileno())
        with contextlib.suppress(FileExistsError):
            os.link(scratch, database)
    finally:
        scratch.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def experiment_id(settings: Settings) -> str:
    """The experiment of the trainer's runs, created with its artifacts under the state dir when local."""
    client = tracking(settings)
    experiment = client.get_experiment_by_name(EXPERIMENT)
    if experiment is not None:
        return experiment.experiment_id
    location = None
    if settings.mlflow_tracking_uri is None:
        location = (settings.mlflow_home / "artifacts").as_uri()
    return client.create_experiment(EXPERIMENT, artifact_location=location)


def model_ref(settings: Settings, version: int) -> ModelRef:
    client = tracking(settings)
    found = client.get_model_version(settings.model_name, str(version))
    tags = found.tags
    if THRESHOLD_TAG not in tags or HISTORY_TAG not in tags:
        raise ModelUnusable(f"{settings.model_name} v{version} has no {THRESHOLD_TAG}/{HISTORY_TAG} tags")
    if tags.get(FEATURES_TAG) != str(FEATURE_VERSION):
        raise ModelUnusable(
            f"{settings.model_name} v{version} was trained on features v{tags.get(FEATURES_TAG, '?')}, "
            f"this code computes v{FEATURE_VERSION}: retrain with `iotmon train`"
        )
    return ModelRef(
        settings.model_name, int(found.version), float(tags[THRESHOLD_TAG]), float(tags[HISTORY_TAG]), found.run_id
    )


def champion(settings: Settings) -> ModelRef | None:
    """The version the ``champion`` alias points at, or None when there is none yet."""
    from mlflow.exceptions import MlflowException

    client = tracking(settings)
    try:
        found = client.get_model_version_by_alias(settings.model_name, CHAMPION)
    except MlflowException:
        return None
    return model_ref(settings, int(found.version))


def champion_problems(settings: Settings) -> tuple[ModelRef | None, list[str]]:
    """The champion and why it could not be served; no problems when the alias points at a complete version
    (registered, tagged, artifacts loadable) or at nothing yet. A trainer killed while writing must leave the
    alias on a complete version: it moves only after the model and its tags are in. Needs a Spark session."""
    from mlflow.exceptions import MlflowException

    client = tracking(settings)
    try:
        found = client.get_model_version_by_alias(settings.model_name, CHAMPION)
    except MlflowException:
        return None, []
    label = f"{CHAMPION} alias -> {settings.model_name} v{found.version}"
    if found.status != "READY":
        return None, [f"{label}, whose registration is {found.status}"]
    try:
        ref = model_ref(settings, int(found.version))
        load_pipeline(settings, ref)
    except ModelUnusable as exc:
        return None, [f"{label}, which cannot be served: {exc}"]
    return ref, []


def promote(settings: Settings, version: int) -> None:
    tracking(settings).set_registered_model_alias(settings.model_name, CHAMPION, str(version))


class ModelUnusable(RuntimeError):
    """A registered version that cannot be served (missing tags, unreadable artifacts)."""


def load_pipeline(settings: Settings, ref: ModelRef) -> PipelineModel:
    """The fitted pipeline of ``ref``; needs an active Spark session."""
    import mlflow.spark

    tracking(settings)
    try:
        return mlflow.spark.load_model(ref.uri, dfs_tmpdir=scratch_dir(settings))
    except Exception as exc:  # any failure to materialise the model makes the version unusable
        raise ModelUnusable(f"{ref.name} v{ref.version} cannot be loaded: {exc}") from exc


def scratch_dir(settings: Settings) -> str:
    """Where mlflow.spark stages a model between Spark and the artifact store."""
    scratch = Path(settings.home, "tmp", "mlflow").absolute()
    scratch.mkdir(parents=True, exist_ok=True)
    return str(scratch)


def pip_requirements() -> list[str]:
    """What a served model needs; given explicitly because MLflow's inference costs ~13 s per log."""
    from importlib.metadata import version

    return [f"pyspark=={version('pyspark')}", f"mlflow=={version('mlflow')}"]
