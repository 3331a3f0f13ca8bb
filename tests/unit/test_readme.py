"""The README is what newcomers and dashboards rely on: keep it true to the code."""

from __future__ import annotations

import re

from iotmon.cli import build_parser
from iotmon.config import describe_settings
from iotmon.schema import ALERTS_SCHEMA, ANOMALIES_SCHEMA, BRONZE_SCHEMA, DEVICES_SCHEMA, QUARANTINE_SCHEMA
from tests.support import PROJECT_ROOT

README = (PROJECT_ROOT / "README.md").read_text()


def test_every_setting_is_in_the_configuration_table() -> None:
    documented = set(re.findall(r"^\| `(IOTMON_[A-Z_]+)` \|", README, re.M))
    assert documented == {variable for variable, _, _ in describe_settings()}


def test_every_command_the_readme_mentions_exists() -> None:
    subcommands = build_parser()._subparsers._group_actions[0].choices
    mentioned = set(re.findall(r"`iotmon ([a-z]+)", README))
    assert mentioned and mentioned <= set(subcommands)


def test_every_table_column_is_documented() -> None:
    for schema in (BRONZE_SCHEMA, QUARANTINE_SCHEMA, DEVICES_SCHEMA, ANOMALIES_SCHEMA, ALERTS_SCHEMA):
        for field in schema:
            assert f"`{field.name}`" in README, field.name
