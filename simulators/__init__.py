"""A deterministic IoT fleet simulator that publishes sensor readings, with injected faults, to Kafka.

The public API, used by ``iotmon simulate``, lives in ``simulators.publish``: ``SimulationOptions``,
``SimulationSummary``, ``run_simulation`` and ``write_device_registry``. Everything under it is pure:

* ``fleet``: the devices (ids, types, sites, models, install dates) and the registry rows;
* ``signals``: per-type and per-device signal parameters, normal readings, anomaly episodes;
* ``faults``: late, duplicate and malformed sends, payload corruption, dropouts;
* ``generator``: the stream of outgoing records in send order;
* ``truth``: the ground-truth Parquet rows; ``partitioning``: Kafka's murmur2 key partitioner.
"""
