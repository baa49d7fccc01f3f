"""A small per-thread cache of kernel plans keyed by the content of index tensors.

The memory node calls the attention kernel once per layer with the same step's index tensors
(``qo_indptr``, ``kv_indptr``, ``kv_indices``, ``q_positions``, ``kv_start_pos``), so work that
depends only on them can be done once per step. :func:`lookup` returns a stored plan only when
the hashable ``key`` matches and every index tensor is *equal* (same shape, dtype and values,
``torch.equal``) to a private copy taken when the plan was stored: a caller that reuses or
mutates its tensors can never get a stale plan. Plans are per thread (no locking, and a plan's
buffers are never shared between threads); the ``CAPACITY`` most recently used are kept, fewer
when they hold more than ``CAPACITY_BYTES`` together (the newest one is always kept).
"""
from __future__ import annotations

import threading
from typing import Any, Sequence

import torch

CAPACITY = 8
CAPACITY_BYTES = 256 << 20
_LOCAL = threading.local()


def _entries() -> list:
    entries = getattr(_LOCAL, "entries", None)
    if entries is None:
        entries = _LOCAL.entries = []
    return entries


def _same(saved: Sequence[torch.Tensor], index: Sequence[torch.Tensor]) -> bool:
    for a, b in zip(saved, index):
        if a.shape != b.shape or a.dtype != b.dtype or a.device != b.device \
                or not torch.equal(a, b):
            return False
    return True


def lookup(key: Any, index: Sequence[torch.Tensor]) -> Any | None:
    """The plan stored under ``key`` for index tensors equal to ``index``, or None."""
    entries = _entries()
    for i, (k, saved, plan, _) in enumerate(entries):
        if k == key and len(saved) == len(index) and _same(saved, index):
            if i:
                entries.insert(0, entries.pop(i))
            return plan
    return None


def store(key: Any, index: Sequence[torch.Tensor], plan: Any, nbytes: int = 0) -> None:
    """Remember ``plan`` (holding about ``nbytes``) for ``key`` and (copies of) ``index``;
    evicts the least recently used plans beyond ``CAPACITY`` or ``CAPACITY_BYTES``."""
    entries = _entries()
    saved = tuple(t.clone() for t in index)
    nbytes += sum(t.numel() * t.element_size() for t in saved)
    entries.insert(0, (key, saved, plan, nbytes))
    del entries[CAPACITY:]
    total = 0
    for i, entry in enumerate(entries):
        total += entry[3]
        if i and total > CAPACITY_BYTES:
            del entries[i:]
            break


def clear() -> None:
    """Forget this thread's plans."""
    _entries().clear()
