"""``iotmon dashboard``: a web page over the lake for operators, without Spark.

``lake`` reads the Delta tables with delta-rs (recent rows only), ``models`` asks MLflow for the registered
versions, ``shaping`` turns what they read into what the page shows (pure, unit-tested), and ``app`` is the
Dash layout and its callbacks.
"""
