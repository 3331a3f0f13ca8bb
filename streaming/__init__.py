"""Stage 3 of the data's journey: bronze -> clean readings, windowed analytics, device state, anomaly scores."""
