"""The session's choices that depend on where things are: the checkpoint file manager."""

from __future__ import annotations

from pathlib import Path

import pytest

from iotmon.config import Settings
from iotmon.spark import LOCAL_CHECKPOINT_FILE_MANAGER, checkpoint_file_manager


@pytest.mark.parametrize("root", [None, "/data/checkpoints", "file:///data/checkpoints"])
def test_checkpoints_on_a_local_disk_are_renamed_without_a_process(tmp_path: Path, root: str | None) -> None:
    settings = Settings(home=tmp_path, checkpoints=root)
    assert checkpoint_file_manager(settings) == LOCAL_CHECKPOINT_FILE_MANAGER


@pytest.mark.parametrize("root", ["s3a://bucket/checkpoints", "hdfs://namenode/checkpoints", "abfss://c@a/cp"])
def test_checkpoints_elsewhere_keep_spark_s_own_file_manager(tmp_path: Path, root: str) -> None:
    assert checkpoint_file_manager(Settings(home=tmp_path, checkpoints=root)) is None
