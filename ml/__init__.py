"""Stage 4 of the data's journey: learn anomaly models from the archive and publish them through MLflow."""
