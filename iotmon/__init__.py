"""Shared contracts of the pipeline: settings, event schema, table names, Spark session, embedded broker, CLI."""
