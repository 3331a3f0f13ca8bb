"""The pipeline as a whole: which streaming queries exist, what each reads and writes, how often it runs.

The stages (``ingest``, ``streaming``) each know their own queries; this package, above them, puts them
together (``pipeline.topology``) and runs them (``pipeline.stream``), beside the rest of the loop in the demo
(``pipeline.demo``). The command line, the backfill and the bench use it, so they all run the same pipeline.
"""
