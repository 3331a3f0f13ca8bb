"""The machine a benchmark ran on, and how much memory the bench's processes used while it ran.

Figures mean little without the machine behind them, so every report carries its cores, memory and load.
Memory is read from Linux ``/proc`` (no extra dependency): the Python driver's resident set and the Spark
JVM's, sampled in a background thread so each phase gets its own peak.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from iotmon.jars import java_home
from iotmon.processes import process_tree, stat_fields

SAMPLE_EVERY_S = 0.5


def parse_meminfo(text: str) -> dict[str, int]:
    """``/proc/meminfo`` as bytes per field (``MemTotal``, ``MemAvailable``, ...)."""
    values: dict[str, int] = {}
    for line in text.splitlines():
        name, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            values[name.strip()] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    return values


def parse_status_rss(text: str) -> int | None:
    """Resident set size in bytes from a ``/proc/<pid>/status`` text (its ``VmRSS`` line), None if absent."""
    for line in text.splitlines():
        if line.startswith("VmRSS:"):
            parts = line.split()
            return int(parts[1]) * 1024
    return None


def rss_bytes(pid: int) -> int | None:
    try:
        return parse_status_rss(Path(f"/proc/{pid}/status").read_text())
    except OSError:
        return None


def java_version() -> str | None:
    """The first line of ``java -version`` of the java Spark's launcher runs: ``$JAVA_HOME``'s, else PATH's."""
    home = java_home()
    java = str(home / "bin" / "java") if home is not None else "java"
    try:
        done = subprocess.run([java, "-version"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = (done.stderr or done.stdout).strip().splitlines()
    return lines[0] if lines else None


def machine_info(spark_master: str, meminfo: str | None = None) -> dict[str, Any]:
    """Cores (all, and those this process may use), memory, load, and the software versions measured."""
    if meminfo is None:
        try:
            meminfo = Path("/proc/meminfo").read_text()
        except OSError:
            meminfo = ""
    memory = parse_meminfo(meminfo)
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    import pyspark

    return {
        "cores": os.cpu_count(),
        "usable_cores": usable,
        "memory_bytes": memory.get("MemTotal"),
        "memory_available_bytes": memory.get("MemAvailable"),
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "java": java_version(),
        "pyspark": pyspark.__version__,
        "spark_master": spark_master,
    }


class MemorySampler(threading.Thread):
    """Peak resident memory of this Python process and of the Spark JVM, per named phase."""

    def __init__(self, jvm_pid: int | None, every_s: float = SAMPLE_EVERY_S) -> None:
        super().__init__(name="iotmon-bench-memory", daemon=True)
        self.jvm_pid = jvm_pid
        self.every_s = every_s
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._peaks: dict[str, dict[str, int]] = {}
        self._open: set[str] = set()

    def sample(self) -> None:
        readings = {"python_rss_bytes": rss_bytes(os.getpid())}
        if self.jvm_pid is not None:
            readings["jvm_rss_bytes"] = rss_bytes(self.jvm_pid)
        with self._lock:
            for phase in self._open:
                peaks = self._peaks.setdefault(phase, {})
                for key, value in readings.items():
                    if value is not None:
                        peaks[key] = max(peaks.get(key, 0), value)

    def run(self) -> None:
        while not self._stop.wait(self.every_s):
            self.sample()

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        with self._lock:
            self._open.add(name)
        self.sample()
        try:
            yield
        finally:
            self.sample()
            with self._lock:
                self._open.discard(name)

    def peaks(self, name: str) -> dict[str, int]:
        """``python_rss_bytes`` and ``jvm_rss_bytes`` peaks seen during the phase (sampled every ``every_s``)."""
        with self._lock:
            return dict(self._peaks.get(name, {}))

    def stop(self) -> None:
        self._stop.set()


def parse_stat_cpu_ticks(fields: list[str]) -> int:
    """utime + stime + cutime + cstime (clock ticks) from ``/proc/<pid>/stat`` fields after the command name:
    the process's own CPU and that of its children it has already reaped (ended Python workers, commands)."""
    return sum(int(fields[i]) for i in (11, 12, 13, 14))


def process_tree_cpu_seconds(root: int) -> float:
    """CPU seconds used so far by ``root`` and every live descendant (the JVM and its Python workers)."""
    ticks = (parse_stat_cpu_ticks(fields) for pid in process_tree(root) if (fields := stat_fields(pid)))
    return sum(ticks) / os.sysconf("SC_CLK_TCK")


# What a Spark JVM's threads do, by name as /proc shows it (cut to 15 characters, so these prefixes fit). A
# thread's CPU is counted under the name it has when sampled: Spark 4 renames a task thread between tasks
# ("Executor task launch worker for task ..." -> "Executor task idle worker#N"), so both are tasks.
THREAD_ROLES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("JIT compiler", ("C1 CompilerThre", "C2 CompilerThre", "Sweeper thread")),
    ("garbage collector", ("GC Thread", "G1 ")),
    ("Spark tasks", ("Executor task",)),
    ("query drivers", ("stream executio",)),
    ("listener bus", ("spark-listener-",)),
    ("DAG scheduler", ("dag-scheduler-e",)),
)
OTHER_THREADS = "other JVM threads"
ENDED_THREADS = "JVM threads that ended"
CHILD_PROCESSES = "child processes"
"""Everything under the JVM: its Python workers, and the commands it runs (on a local disk without Hadoop's native
library, a ``chmod`` for every file Hadoop creates and a ``readlink`` for every rename through ``FileContext``)."""
PYTHON_DRIVER = "Python driver"


def thread_role(name: str) -> str:
    return next((role for role, prefixes in THREAD_ROLES if name.startswith(prefixes)), OTHER_THREADS)


def reaped_cpu_seconds(pid: int) -> float:
    """utime + stime of the process and of the children it has reaped (0 once it is gone). Unlike the tree's
    sum it never falls: a descendant that ends under a parent outside the tree (a Python worker its daemon
    leaves) takes its CPU out of the tree, which measured one Delta write at -1.83 s."""
    fields = stat_fields(pid)
    return parse_stat_cpu_ticks(fields) / os.sysconf("SC_CLK_TCK") if fields else 0.0


def own_cpu_seconds(pid: int) -> float:
    """utime + stime of the process itself, without its children (0 once it is gone)."""
    fields = stat_fields(pid)
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK") if fields else 0.0


def thread_cpu_seconds(pid: int) -> dict[int, tuple[str, float]]:
    """Each live thread of ``pid``: its name and the CPU seconds it has used (``/proc/<pid>/task``)."""
    threads: dict[int, tuple[str, float]] = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return threads
    for tid in tids:
        try:
            text = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
        except OSError:
            continue  # ended meanwhile
        name, fields = text[text.index("(") + 1 : text.rindex(")")], text[text.rindex(")") + 2 :].split()
        threads[int(tid)] = (name, (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"))
    return threads


def cpu_by_role(
    before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]], process_seconds: float
) -> dict[str, float]:
    """CPU seconds per thread role between two snapshots of a process that used ``process_seconds`` meanwhile.
    A thread that ended in between took its figures with it: what the process used beyond its live threads is
    reported as such, not guessed into a role."""
    by_role = {role: 0.0 for role, _ in THREAD_ROLES} | {OTHER_THREADS: 0.0}
    for tid, (name, seconds) in after.items():
        by_role[thread_role(name)] += seconds - (before[tid][1] if tid in before else 0.0)
    by_role[ENDED_THREADS] = max(0.0, process_seconds - sum(by_role.values()))
    return by_role


def jvm_pid(spark: Any) -> int:
    """The process id of a local Spark session's JVM (the driver, and in local mode every executor thread)."""
    return int(spark.sparkContext._jvm.java.lang.ProcessHandle.current().pid())


def application_cpu(spark: Any, counters: Mapping[str, Callable[[], float]] | None = None) -> CpuMeter:
    """A ``CpuMeter`` of this Spark application: its JVM with every process under it, and this Python process,
    where ``foreachBatch`` functions run. Not the broker's: the pipeline's own cost, as the ceiling's is Spark's."""
    return CpuMeter(jvm_pid(spark), os.getpid(), counters)


class CpuMeter:
    """Average cores a Spark application used between ``start()`` and ``stop()``, and where they went.

    The application is the JVM ``jvm`` with every process under it (``CHILD_PROCESSES``) and, given, the Python
    ``driver`` process itself (``foreachBatch`` functions run there; not its other children). ``parts`` splits
    the total by the JVM's thread roles (JIT compiler, garbage collector, Spark's tasks, the queries' driver
    threads that plan and commit each batch, ...), the child processes and the Python driver: the cost model's
    fixed per-batch costs and per-row costs, measured on the running stream. ``counters`` are cumulative
    figures of the application (how many classes Spark generated, say), each reported as its growth.
    """

    def __init__(
        self, jvm: int, driver: int | None = None, counters: Mapping[str, Callable[[], float]] | None = None
    ) -> None:
        self.jvm, self.driver = jvm, driver
        self.counters = dict(counters or {})
        self._started: dict[str, Any] | None = None

    def start(self) -> CpuMeter:
        self._started = self._sample()
        return self

    def stop(self) -> dict[str, Any]:
        assert self._started is not None, "CpuMeter.stop() before start()"
        now, then = self._sample(), self._started
        wall = now["time"] - then["time"]
        jvm_own = now["jvm"] - then["jvm"]
        parts = cpu_by_role(then["threads"], now["threads"], jvm_own)
        parts[CHILD_PROCESSES] = max(0.0, (now["tree"] - then["tree"]) - jvm_own)
        if self.driver is not None:
            parts[PYTHON_DRIVER] = now["driver"] - then["driver"]
        cpu = sum(parts.values())
        used: dict[str, Any] = {
            "seconds": round(wall, 3),
            "cpu_seconds": round(cpu, 3),
            "cores": round(cpu / wall, 3) if wall else 0.0,
            "parts": {name: round(seconds, 3) for name, seconds in parts.items()},
        }
        for name, value in now["counters"].items():
            used[name] = round(value - then["counters"][name], 3)
        return used

    def _sample(self) -> dict[str, Any]:
        return {
            "time": time.monotonic(),
            "tree": process_tree_cpu_seconds(self.jvm),
            "jvm": own_cpu_seconds(self.jvm),
            "threads": thread_cpu_seconds(self.jvm),
            "driver": own_cpu_seconds(self.driver) if self.driver is not None else 0.0,
            "counters": {name: float(read()) for name, read in self.counters.items()},
        }


def directory_bytes(path: str | Path) -> int:
    """Bytes under a local directory (0 if missing): a state store's size on disk."""
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.path.getsize(os.path.join(root, name))
            except OSError:
                continue
    return total
