"""Child processes of this test process that are alive, less multiprocessing's resource
tracker and fork server (each lives as long as this process, once anything was started). A child may exit or
turn zombie between two psutil calls: such a child is not alive."""
from __future__ import annotations

import psutil


def live_children() -> set[int]:
    pids = set()
    for p in psutil.Process().children(recursive=True):
        try:
            cmd = " ".join(p.cmdline())
            if p.status() != psutil.STATUS_ZOMBIE and not any(
                    helper in cmd for helper in ("resource_tracker", "multiprocessing.forkserver")):
                pids.add(p.pid)
        except (psutil.ZombieProcess, psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return pids
