"""What Linux's /proc says about a local process (None where there is no /proc or no process)."""

from __future__ import annotations


def resident_bytes(pid: int) -> int | None:
    """The resident set size of process `pid` in bytes (VmRSS)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        return None
    return None
