"""Process trees from Linux ``/proc``: which processes a command started (its Spark JVM, Python workers), what
CPU they used, and lowering their scheduling priority. No extra dependency; elsewhere than Linux the tree is
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


def lower_priority(root: int, niceness: int) -> int:
    """Give every thread of ``root``'s process tree at least ``niceness``; threads they start inherit it.

    Linux keeps a nice value per thread, so ``os.nice`` in a running process leaves its other threads (a
    JVM's compiler, GC and task threads) as they were: each thread is set. Returns how many were lowered.
    """
    lowered = 0
    for pid in process_tree(root):
        try:
            threads = [int(t.name) for t in Path(f"/proc/{pid}/task").iterdir()]
        except OSError:
            continue
        for tid in threads:
            try:
                if os.getpriority(os.PRIO_PROCESS, tid) < niceness:
                    os.setpriority(os.PRIO_PROCESS, tid, niceness)
                    lowered += 1
            except OSError:  # the thread ended meanwhile
                continue
    return lowered
