"""Where start-up time goes: named stages, timed where they run, reported together.

:func:`stage` (a context manager) adds the wall seconds of its block to this process's record
under its name (a name met twice adds up). A role process sends its record with its first PING
reply (:func:`take`), and the engine files it under the role's name with the role's whole
start (:func:`add_role`: spawn to that reply), so one record in the engine's process says where
an ``LLM(...)``'s seconds went; ``bench/startup.py`` prints it per placement. Records hold plain
floats (they travel as JSON meta).
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Iterator

_RECORD: dict[str, float] = {}


@contextmanager
def stage(name: str) -> Iterator[None]:
    """Time the block under ``name`` in this process's record."""
    t0 = time.perf_counter()
    try:
        yield
    finally:
        _RECORD[name] = _RECORD.get(name, 0.0) + time.perf_counter() - t0


def add_role(role: str, start_s: float, stages: dict) -> None:
    """File a role's own record (from its PING reply) under ``role``, with ``start_s`` (spawn
    to its first reply) and what its own stages leave of it (``start, other``: the process's
    start-up, imports, waiting)."""
    own = {str(k): float(v) for k, v in stages.items() if isinstance(v, (int, float))}
    _RECORD[f"{role}: start"] = start_s
    for k, v in own.items():
        _RECORD[f"{role}: {k}"] = v
    _RECORD[f"{role}: start, other"] = max(0.0, start_s - sum(own.values()))


def take() -> dict[str, float]:
    """This process's record so far, in the order stages first ended; the record is cleared."""
    out = dict(_RECORD)
    _RECORD.clear()
    return out


def roles_ready(record: dict[str, float]) -> str:
    """Each role's start in a record, for a log line: ``memory node 0 2.0 s, replica 0 3.9 s``
    (empty: no role process)."""
    return ", ".join(f"{k.removesuffix(': start')} {v:.1f} s" for k, v in record.items()
                     if k.endswith(": start"))
