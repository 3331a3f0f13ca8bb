from pathlib import Path

import pytest

from iotmon.config import ConfigError, Settings, describe_settings, interval_seconds


def test_defaults_are_local_and_derived_from_home() -> None:
    settings = Settings.from_env({})
    assert settings.kafka_bootstrap == "127.0.0.1:9092"
    assert settings.lake_root == str((Path("var") / "lake").absolute())
    assert settings.checkpoint_path("bronze") == str((Path("var") / "checkpoints" / "bronze").absolute())
    assert settings.cache == (Path("var") / "cache").absolute()
    assert (settings.dashboard_host, settings.dashboard_port) == ("127.0.0.1", 8050)  # not exposed by default


def test_environment_overrides_with_types() -> None:
    settings = Settings.from_env(
        {
            "IOTMON_HOME": "/data/iot",
            "IOTMON_LAKE": "s3a://bucket/lake",
            "IOTMON_TOPIC_PARTITIONS": "12",
            "IOTMON_MAX_OFFSETS_PER_TRIGGER": "none",
            "IOTMON_TRIGGER_INTERVAL": "30 seconds",
            "IOTMON_DASHBOARD_HOST": "0.0.0.0",
            "IOTMON_DASHBOARD_PORT": "9000",
        }
    )
    assert settings.home == Path("/data/iot")
    assert settings.table_path("bronze") == "s3a://bucket/lake/bronze"
    assert settings.checkpoint_root == "/data/iot/checkpoints"
    assert settings.topic_partitions == 12
    assert settings.max_offsets_per_trigger is None
    assert interval_seconds(settings.trigger_interval) == 30
    assert (settings.dashboard_host, settings.dashboard_port) == ("0.0.0.0", 9000)


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("IOTMON_TOPIC_PARTITIONS", "many"),
        ("IOTMON_TOPIC_PARTITIONS", "-1"),
        ("IOTMON_TRIGGER_INTERVAL", "soon"),
        ("IOTMON_WATERMARK", "5 fortnights"),
        ("IOTMON_DASHBOARD_PORT", "70000"),
        ("IOTMON_DASHBOARD_PORT", "0"),
        ("IOTMON_DASHBOARD_LOOKBACK", "a while"),
    ],
)
def test_bad_values_name_the_variable(variable: str, value: str) -> None:
    with pytest.raises(ConfigError, match=variable):
        Settings.from_env({variable: value})


def test_bootstrap_must_be_host_port() -> None:
    with pytest.raises(ConfigError, match="IOTMON_KAFKA_BOOTSTRAP"):
        _ = Settings.from_env({"IOTMON_KAFKA_BOOTSTRAP": "localhost"}).kafka_host_port


def test_to_env_round_trips() -> None:
    settings = Settings.from_env({}, home=Path("/x"), max_offsets_per_trigger=None, topic="t")
    assert Settings.from_env(settings.to_env()) == settings


def test_every_setting_is_documented() -> None:
    rows = describe_settings()
    assert len(rows) == len({name for name, _, _ in rows})
    assert all(name.startswith("IOTMON_") and meaning for name, _, meaning in rows)
