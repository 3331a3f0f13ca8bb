"""The lake as one SQL catalogue: every table registered under its name, for ad-hoc questions."""

from __future__ import annotations

from delta.tables import DeltaTable
from pyspark.sql import DataFrame, SparkSession

from iotmon.config import Settings
from iotmon.schema import LAKE_TABLES


def register_tables(spark: SparkSession, settings: Settings) -> list[str]:
    """Register each existing lake table as a temporary view named after it; return the names."""
    registered = []
    for table in LAKE_TABLES:
        path = settings.table_path(table)
        if DeltaTable.isDeltaTable(spark, path):
            spark.read.format("delta").load(path).createOrReplaceTempView(table)
            registered.append(table)
    return registered


def run_sql(spark: SparkSession, settings: Settings, statement: str) -> DataFrame:
    register_tables(spark, settings)
    return spark.sql(statement)
