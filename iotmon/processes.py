"""Process trees from Linux ``/proc``: which processes a command started (its Spark JVM, Python workers), what
CPU they used, and making them run on what the others leave. No extra dependency; elsewhere than Linux the tree is
just the root."""

from __future__ import annotations

import os
from pathlib import Path


def stat_fields(pid: int) -> list[str] | None:
    """``/proc/<pid>/stat`` after the command name (state, ppid, ...), None once the process is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rindex(")") + 2 :].split()  # the command name may hold spaces and parentheses


def process_tree(root: int) -> set[int]:
    """``root`` and every live descendant."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (fields := stat_fields(int(entry.name))) is not None:
            parents[int(entry.name)] = int(fields[1])
    tree, frontier = {root}, [root]
    while frontier:
        parent = frontier.pop()
        children = [pid for pid, ppid in parents.items() if ppid == parent and pid not in tree]
        tree.update(children)
        frontier.extend(children)
    return tree


def run_when_idle(root: int) -> int:
    """Put every thread of ``root``'s process tree under Linux's ``SCHED_IDLE`` policy; threads they start inherit it.

    Such a thread runs on what the others leave: it weighs 3 against a normal thread's 1024, where ``nice 10``
    still weighs 110, a tenth of a core taken from a stream that wants both. The policy is kept per thread, so a
    running process's other threads (a JVM's compiler, collector and task threads) are each set. Returns how many
    were switched.
    """
    switched = 0
    for pid in process_tree(root):
        try:
            threads = [int(t.name) for t in Path(f"/proc/{pid}/task").iterdir()]
        except OSError:
            continue
        for tid in threads:
            try:
                if os.sched_getscheduler(tid) != os.SCHED_IDLE:
                    os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
                    switched += 1
            except OSError:  # the thread ended meanwhile
                continue
    return switched


def yield_the_session() -> bool:
    """Lower this process's session against the others, if the process leads it. True if it did.

    Under autogroup scheduling (``/proc/sys/kernel/sched_autogroup_enabled``, sched(7)) Linux shares the cores
    between sessions first and then among each session's threads, so a thread's policy orders it only within
    its session: a trainer leading a session of its own (a service, ``setsid``) would still get half the cores
    against the stream's session. Its autogroup's nice is set to 19. A process that does not lead its session
    leaves it alone: the session may hold the stream too (the bench, a shell that started both), and the
    setting would outlive the process.
    """
    if os.getsid(0) != os.getpid():
        return False
    try:
        Path("/proc/self/autogroup").write_text("19")
    except OSError:  # a kernel without autogroups
        return False
    return True
