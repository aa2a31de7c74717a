"""What Linux's /proc says about a local process (None where there is no /proc or no process)."""

from __future__ import annotations

import os


def _kib_field(path: str, name: str) -> int | None:
    """The ``name: N kB`` line of a /proc file, in bytes."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(name):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        return None
    return None


def resident_bytes(pid: int) -> int | None:
    """The resident set size of process `pid` in bytes (VmRSS)."""
    return _kib_field(f"/proc/{pid}/status", "VmRSS:")


def children_map() -> dict[int, list[int]]:
    """Parent pid -> its children's pids, for every process /proc lists now."""
    children: dict[int, list[int]] = {}
    try:
        entries = [e for e in os.listdir("/proc") if e.isdigit()]
    except OSError:
        return children
    for entry in entries:
        try:
            with open(f"/proc/{entry}/stat") as f:
                # The command name (field 2) may hold spaces and parentheses: the parent pid is the
                # second field after its closing parenthesis.
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    return children


def process_tree(pid: int) -> list[int]:
    """`pid` and all its descendants alive now."""
    children = children_map()
    tree, todo = [], [pid]
    while todo:
        p = todo.pop()
        tree.append(p)
        todo.extend(children.get(p, ()))
    return tree


def proportional_bytes(pid: int) -> int | None:
    """The proportional set size of process `pid` in bytes (Pss: each shared page divided among
    the processes that map it, so a tree's sum counts shared weights once)."""
    return _kib_field(f"/proc/{pid}/smaps_rollup", "Pss:")


def tree_proportional_bytes(pid: int) -> int | None:
    """The summed Pss of `pid` and its descendants (a server and its worker or engine processes)."""
    sizes = [s for s in (proportional_bytes(p) for p in process_tree(pid)) if s is not None]
    return sum(sizes) if sizes else None
