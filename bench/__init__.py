"""Measurements of the running system: latency, throughput and scale, read back from the lake."""
