"""Kafka security settings reach every client from one place, and a secret never shows."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from iotmon import broker
from iotmon.cli import main
from iotmon.config import REDACTED, ConfigError, Secret, Settings, describe_settings
from iotmon.kafka import client_config, jaas_config, spark_kafka_options
from iotmon.spark import SPARK_OPTIONS_REDACTION

PASSWORD = "pa55-w0rd-xyzzy"
SASL_ENV = {
    "IOTMON_KAFKA_BOOTSTRAP": "broker1:9094,broker2:9094",
    "IOTMON_KAFKA_SECURITY_PROTOCOL": "sasl_ssl",
    "IOTMON_KAFKA_SASL_MECHANISM": "scram-sha-512",
    "IOTMON_KAFKA_SASL_USERNAME": "iotmon",
    "IOTMON_KAFKA_SASL_PASSWORD": PASSWORD,
    "IOTMON_KAFKA_SSL_CA_LOCATION": "/etc/ssl/kafka-ca.pem",
}


def test_defaults_are_plaintext_without_credentials() -> None:
    settings = Settings.from_env({})
    assert settings.kafka_security_protocol == "PLAINTEXT"
    assert settings.kafka_sasl_password is None
    assert client_config(settings) == {"bootstrap.servers": "127.0.0.1:9092", "security.protocol": "plaintext"}
    assert spark_kafka_options(settings) == {
        "kafka.bootstrap.servers": "127.0.0.1:9092",
        "kafka.security.protocol": "PLAINTEXT",
    }


def test_sasl_ssl_reaches_both_kinds_of_client() -> None:
    settings = Settings.from_env(SASL_ENV)
    assert client_config(settings) == {
        "bootstrap.servers": "broker1:9094,broker2:9094",
        "security.protocol": "sasl_ssl",
        "sasl.mechanisms": "SCRAM-SHA-512",
        "sasl.username": "iotmon",
        "sasl.password": PASSWORD,
        "ssl.ca.location": "/etc/ssl/kafka-ca.pem",
    }
    assert spark_kafka_options(settings) == {
        "kafka.bootstrap.servers": "broker1:9094,broker2:9094",
        "kafka.security.protocol": "SASL_SSL",
        "kafka.sasl.mechanism": "SCRAM-SHA-512",
        "kafka.sasl.jaas.config": "org.apache.kafka.common.security.scram.ScramLoginModule required "
        f'username="iotmon" password="{PASSWORD}";',
        "kafka.ssl.truststore.type": "PEM",
        "kafka.ssl.truststore.location": "/etc/ssl/kafka-ca.pem",
    }


def test_plain_uses_the_plain_login_module_and_quotes_values() -> None:
    plain = Settings.from_env(
        {"IOTMON_KAFKA_SECURITY_PROTOCOL": "SASL_PLAINTEXT", "IOTMON_KAFKA_SASL_USERNAME": "u"},
        kafka_sasl_password=Secret('a"b\\c'),
    )
    options = spark_kafka_options(plain)
    assert options["kafka.sasl.jaas.config"] == (
        'org.apache.kafka.common.security.plain.PlainLoginModule required username="u" password="a\\"b\\\\c";'
    )
    assert "kafka.ssl.truststore.location" not in options  # no TLS with SASL_PLAINTEXT
    assert jaas_config("M", "x", "y") == 'M required username="x" password="y";'


@pytest.mark.parametrize(
    ("variable", "value"),
    [("IOTMON_KAFKA_SECURITY_PROTOCOL", "TLS"), ("IOTMON_KAFKA_SASL_MECHANISM", "GSSAPI")],
)
def test_unknown_protocols_and_mechanisms_are_refused(variable: str, value: str) -> None:
    with pytest.raises(ConfigError, match=variable):
        Settings.from_env({variable: value})


def test_sasl_without_credentials_names_the_missing_variables_not_the_password() -> None:
    settings = Settings.from_env({**SASL_ENV, "IOTMON_KAFKA_SASL_USERNAME": ""})
    with pytest.raises(ConfigError, match="IOTMON_KAFKA_SASL_USERNAME") as raised:
        client_config(settings)
    assert PASSWORD not in str(raised.value)
    with pytest.raises(ConfigError, match="IOTMON_KAFKA_SASL_PASSWORD"):
        spark_kafka_options(dataclasses.replace(settings, kafka_sasl_username="u", kafka_sasl_password=None))


def test_a_secret_prints_as_a_mask_everywhere_but_to_env() -> None:
    settings = Settings.from_env(SASL_ENV)
    assert isinstance(settings.kafka_sasl_password, Secret)
    for shown in (str(settings), repr(settings), f"{settings.kafka_sasl_password}", str(settings.kafka_sasl_password)):
        assert PASSWORD not in shown
    assert f"{settings.kafka_sasl_password:>5}" == "  ***"
    # A child process gets the real value and rebuilds the same settings.
    assert settings.to_env()["IOTMON_KAFKA_SASL_PASSWORD"] == PASSWORD
    assert Settings.from_env(settings.to_env()) == settings
    assert settings.redact(f"failed: password={PASSWORD}!") == f"failed: password={REDACTED}!"
    assert Settings.from_env({}).redact("nothing to hide") == "nothing to hide"


def test_secret_settings_are_marked_in_their_metadata() -> None:
    secret = {f.name for f in dataclasses.fields(Settings) if f.metadata["secret"]}
    assert secret == {"kafka_sasl_password"}


def test_security_settings_follow_the_kafka_block_in_the_reference() -> None:
    variables = [variable for variable, _, _ in describe_settings()]
    start = variables.index("IOTMON_TOPIC_PARTITIONS") + 1
    assert variables[start : start + 5] == [
        "IOTMON_KAFKA_SECURITY_PROTOCOL",
        "IOTMON_KAFKA_SASL_MECHANISM",
        "IOTMON_KAFKA_SASL_USERNAME",
        "IOTMON_KAFKA_SASL_PASSWORD",
        "IOTMON_KAFKA_SSL_CA_LOCATION",
    ]


def test_iotmon_config_never_shows_the_password(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    for variable, value in SASL_ENV.items():
        monkeypatch.setenv(variable, value)
    assert main(["config"]) == 0
    out = capsys.readouterr().out
    assert "IOTMON_KAFKA_SASL_PASSWORD" in out and PASSWORD not in out


def test_object_store_credentials_never_enter_the_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    credentials = {
        "AWS_ACCESS_KEY_ID": "AKIAEXAMPLEKEYID0001",
        "AWS_SECRET_ACCESS_KEY": "wJalrXUtnFEMI-example-secret-key",
        "AWS_SESSION_TOKEN": "session-token-example-0001",
        "MLFLOW_TRACKING_PASSWORD": "mlflow-password-example",
    }
    for variable, value in credentials.items():
        monkeypatch.setenv(variable, value)
    settings = Settings.from_env()
    shown = "\n".join([repr(settings), *settings.to_env().values(), *map(str, describe_settings())])
    for value in credentials.values():
        assert value not in shown


def test_spark_masks_the_kafka_jaas_option() -> None:
    pattern = re.compile(SPARK_OPTIONS_REDACTION)
    assert pattern.search("kafka.sasl.jaas.config") and pattern.search("kafka.sasl.password")
    assert pattern.search("url")  # Spark's default kept
    assert not pattern.search("kafka.bootstrap.servers") and not pattern.search("subscribe")


def test_embedded_broker_listens_with_sasl_plain_when_asked(tmp_path: Path) -> None:
    settings = Settings.from_env(
        {
            "IOTMON_KAFKA_SECURITY_PROTOCOL": "SASL_PLAINTEXT",
            "IOTMON_KAFKA_SASL_USERNAME": "iotmon",
            "IOTMON_KAFKA_SASL_PASSWORD": PASSWORD,
        },
        home=tmp_path,
    )
    props = dict(
        line.split("=", 1) for line in broker._server_properties(settings, broker.broker_paths(settings)).splitlines()
    )
    assert props["listeners"] == "SASL_PLAINTEXT://127.0.0.1:9092,CONTROLLER://127.0.0.1:9093"
    assert props["listener.security.protocol.map"] == "SASL_PLAINTEXT:SASL_PLAINTEXT,CONTROLLER:PLAINTEXT"
    assert props["sasl.enabled.mechanisms"] == "PLAIN"
    assert f'user_iotmon="{PASSWORD}";' in props["listener.name.sasl_plaintext.plain.sasl.jaas.config"]


@pytest.mark.parametrize(
    ("protocol", "mechanism"), [("SSL", "PLAIN"), ("SASL_SSL", "PLAIN"), ("SASL_PLAINTEXT", "SCRAM-SHA-256")]
)
def test_embedded_broker_refuses_what_it_cannot_serve(tmp_path: Path, protocol: str, mechanism: str) -> None:
    settings = Settings.from_env(
        {"IOTMON_KAFKA_SECURITY_PROTOCOL": protocol, "IOTMON_KAFKA_SASL_MECHANISM": mechanism}, home=tmp_path
    )
    with pytest.raises(broker.BrokerError, match="PLAINTEXT or SASL_PLAINTEXT with PLAIN"):
        broker._server_properties(settings, broker.broker_paths(settings))
