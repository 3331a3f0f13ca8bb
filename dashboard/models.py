"""The model history from MLflow's registry: registered versions, their runs' metrics and the champion.

MLflow is imported once, when the app is built (``dashboard.app.create_app``), not by the first request thread
that asks; a local registry that does not exist yet is not created by looking at it: no database file means no
models yet.
"""

from __future__ import annotations

from datetime import UTC, datetime

from dashboard.shaping import MODEL_METRICS, ModelHistory, ModelVersion, model_history
from iotmon.config import Settings


def _millis(value: int | None) -> datetime | None:
    return None if value is None else datetime.fromtimestamp(value / 1000, UTC)


def registry_exists(settings: Settings) -> bool:
    """False for the local default registry before the first training run; a configured one is asked."""
    if settings.mlflow_tracking_uri is not None:
        return True
    return settings.mlflow_database.exists()


def read_model_history(settings: Settings, limit: int = 20) -> ModelHistory | None:
    """The latest ``limit`` versions of ``Settings.model_name`` and the champion; None when no model exists."""
    if not registry_exists(settings):
        return None
    from mlflow.exceptions import MlflowException

    from ml.registry import CHAMPION, DECISION_TAG, PROMOTED_TAG, tracking

    client = tracking(settings)
    try:
        found = client.search_model_versions(
            f"name = '{settings.model_name}'", max_results=limit, order_by=["version_number DESC"]
        )
    except MlflowException:
        return None
    if not found:
        return None
    try:
        champion: int | None = int(client.get_model_version_by_alias(settings.model_name, CHAMPION).version)
    except MlflowException:
        champion = None
    versions = []
    for version in found:
        metrics: dict[str, float] = {}
        tags: dict[str, str] = {}
        end = None
        if version.run_id:
            try:
                run = client.get_run(version.run_id)
                metrics, tags, end = run.data.metrics, run.data.tags, run.info.end_time
            except MlflowException:  # a version registered from a deleted run: no metrics to show
                pass
        versions.append(
            ModelVersion(
                version=int(version.version),
                created=_millis(version.creation_timestamp),
                decision=tags.get(DECISION_TAG),
                promoted_at=_millis(end) if tags.get(PROMOTED_TAG) == "True" else None,
                metrics={name: metrics[name] for name in MODEL_METRICS if name in metrics},
            )
        )
    return model_history(versions, champion)
