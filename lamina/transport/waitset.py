"""One thread waiting on several receive rings and on what other threads hand it, at once.

A role whose main thread receives on some channels itself (a compute replica's links to its
memory nodes) and gets the rest from reader threads through a queue waits here: one native
call (:func:`shm_ring.cpp wait_any <lamina.transport.shm_fast>`) polls every ring's head and a
posted count without the GIL for the spin time, then sleeps in one ``poll()`` on the rings'
doorbells and an eventfd that :meth:`WaitSet.post` writes while the waiter sleeps. A result
that lands on a ring therefore wakes the thread that uses it, not a reader thread that would
hand it over through a queue (two wake-ups and a GIL hand-off per message).

Contract: :meth:`wait` is called by one thread, the only receiver on every channel it names;
:meth:`post` by any thread, after it put an item where the waiter looks (a queue). The waiter
reads :attr:`posted` *before* it looks into the queue and passes it to :meth:`wait`, so an item
posted in between ends the wait at once.
"""
from __future__ import annotations

import os
import weakref
from types import ModuleType
from typing import Sequence

import numpy as np

from lamina.transport.base import Channel
from lamina.transport.ring_memory import YIELD_EVERY

POSTED = -1  # wait(): something was posted
TIMED_OUT = -2  # wait(): the timeout passed (or a doorbell rang for nothing): check the peers


class WaitSet:
    """The posted count, the sleeping flag and the eventfd of one waiting thread.

    ``spin_us``: how long :meth:`wait` polls before it sleeps (``inf``: polls for good, yielding
    the core now and then, as a receiver that owns its core does)."""

    def __init__(self, fast: ModuleType, spin_us: float) -> None:
        if spin_us < 0:
            raise ValueError("spin_us must be >= 0")
        self._fast = fast
        self._words = np.zeros(2, dtype=np.int64)  # posted count, sleeping flag (C++ kPosted...)
        self._addr = self._words.ctypes.data
        self._fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        # closed with the object, not before: a producer thread may post until its end
        weakref.finalize(self, os.close, self._fd)
        self._forever = spin_us == float("inf")
        self._spin_ns = 1 << 62 if self._forever else int(spin_us * 1e3)
        self._yield_every = YIELD_EVERY if self._forever else 0

    @staticmethod
    def handles(channels: Sequence[Channel]) -> list[tuple[int, int, int]] | None:
        """The rings of ``channels`` for :meth:`wait`, or None if one of them has none."""
        out = [ch.wait_handle() for ch in channels]
        return None if any(h is None for h in out) else out

    @property
    def posted(self) -> int:
        return int(self._words[0])

    def post(self) -> None:
        """Count one item handed to the waiter; wake it if it sleeps. Any thread."""
        self._fast.post(self._addr, self._fd)

    def spin(self, timeout_s: float) -> tuple[int, int]:
        """``(spin_ns, yield_every)`` of a poll that stands for one :meth:`wait` of
        ``timeout_s`` (:meth:`RingChannel.exchange <lamina.transport.ring.RingChannel.exchange>`):
        the spin time, or the whole timeout, yielding now and then, for a waiter that polls for
        good."""
        if self._forever:
            return int(timeout_s * 1e9), self._yield_every
        return self._spin_ns, 0

    def ready(self, rings: list[tuple[int, int, int]]) -> bool:
        """Whether one of ``rings`` holds unread bytes now (one look, no wait)."""
        return bool(rings) and self._fast.wait_any(rings, self._addr, self.posted, self._fd,
                                                   0, 0, 0) >= 0

    def wait(self, rings: list[tuple[int, int, int]], seen: int, timeout_s: float) -> int:
        """Until one of ``rings`` (from :meth:`handles`) holds unread bytes (its index), the
        posted count differs from ``seen`` (:data:`POSTED`), or ``timeout_s`` passed
        (:data:`TIMED_OUT`; a waiter that polls for good returns then too, to check its
        peers)."""
        timeout_ns = int(timeout_s * 1e9)
        if self._forever:
            return self._fast.wait_any(rings, self._addr, seen, self._fd, timeout_ns,
                                       self._yield_every, 0)
        return self._fast.wait_any(rings, self._addr, seen, self._fd, self._spin_ns, 0,
                                   timeout_ns)
