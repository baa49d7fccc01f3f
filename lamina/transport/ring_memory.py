"""The memory under the ring protocol of :mod:`lamina.transport.ring`: the ring's layout, the
two-call primitive (:class:`RingMemory`: ``store`` a control word, ``publish`` data bytes, each
reaching the peer's copy), wake-ups (:class:`Bell`) and the spin-then-block wait on a counter
(:func:`wait_for`). Shared memory (:mod:`lamina.transport.shm_ring`) and RDMA
(:mod:`lamina.transport.rdma`) implement :class:`RingMemory`.
"""
from __future__ import annotations

import os
import threading
import time
from abc import ABC, abstractmethod
from typing import Any, Callable

CTL_BYTES = 4096
# control words (u64 index; x8 = byte offset): one 64-byte line each. The C++ fast path keeps a
# copy of those it touches (shm_fast.CTL_WORDS), checked against these at every load.
HEAD, TAIL, R_WAIT, W_WAIT, W_CLOSED, R_CLOSED, W_PID, R_PID, MAGIC, CAP = \
    0, 8, 16, 24, 32, 40, 48, 56, 64, 72
RING_MAGIC = int.from_bytes(b"LMNARING", "little")
YIELD_EVERY = 16  # a receiver spinning for good yields its core every this many rounds of 64 polls
_FENCE_LOCK = threading.Lock()


def fence() -> None:
    """Full memory barrier (a locked read-modify-write inside the lock implementation)."""
    _FENCE_LOCK.acquire()
    _FENCE_LOCK.release()


class Bell(ABC):
    """A wake-up: ``ring`` tells the peer's sleeper to look again, ``wait`` sleeps until rung
    or ``timeout`` seconds passed."""

    @abstractmethod
    def ring(self) -> None: ...

    @abstractmethod
    def wait(self, timeout: float) -> None: ...


class PollBell(Bell):
    """No doorbell: the sleeper re-polls every ``interval`` seconds (RDMA: nothing can wake
    a thread on the far host but the memory it polls)."""

    def __init__(self, interval: float = 50e-6) -> None:
        self.interval = interval

    def ring(self) -> None:
        pass

    def wait(self, timeout: float) -> None:
        time.sleep(min(timeout, self.interval))


class RingMemory(ABC):
    """One direction's ring as one end sees it: ``ctl`` (u64 words) and ``data`` (bytes) are
    this end's copy, ``ctl_addr``/``data_addr`` their addresses (for the C++ fast path), and
    ``data_bell``/``space_bell`` the wake-ups for "data arrived" and "space freed".
    ``mirrored``: writes must be published to reach the peer (False: one shared mapping)."""

    capacity: int
    ctl: memoryview
    data: memoryview
    ctl_addr: int
    data_addr: int
    data_bell: Bell
    space_bell: Bell
    mirrored: bool = False

    def store(self, word: int, value: int) -> None:
        """Set control word ``word`` here and at the peer."""
        self.ctl[word] = value

    def publish(self, start: int, end: int) -> None:  # noqa: B027 - shared mapping: nothing
        """Make data bytes ``[start, end)`` (stream counts, ``end - start <= capacity``)
        visible at the peer."""

    @abstractmethod
    def release(self, unlink: bool) -> None:
        """Unmap / deregister; ``unlink``: the creator also removes what names the ring."""


def wait_for(ring: RingMemory, flag: int, bell: Bell, word: int, base: int, need: int,
             check: Callable[[], None], deadline: float | None, spin_s: float, wake: float,
             fast: Any) -> bool:
    """Spin ``spin_s`` seconds (``inf``: for good), then block on ``bell`` until
    ``ring.ctl[word] - base >= need``; False when ``deadline`` passed. ``check()`` runs every
    ``wake`` seconds and raises to abort (closed / peer died). ``flag`` is this side's waiting
    flag, which the other side reads before ringing. With ``fast`` (the C++ ring module) the
    spin runs without the GIL."""
    ctl = ring.ctl

    def ready() -> bool:
        return ctl[word] - base >= need
    if ready():
        return True
    now = time.perf_counter()
    spin_end, next_check = now + spin_s, now + wake
    forever = spin_s == float("inf")
    spins = 0
    while now < spin_end:
        if fast is not None:  # a C++ spin until the spin ends or the next check is due
            budget = min(spin_end, next_check) - now
            if fast.ring_wait(ring.ctl_addr, word, base, need, int(budget * 1e9),
                              YIELD_EVERY if forever else 0):
                return True
        else:
            if ready():
                return True
            spins += 1
            if forever and not spins & 1023:  # a core of our own: never sleep, but now and
                os.sched_yield()  # then let a runnable thread (and our own, via the GIL) go
        now = time.perf_counter()
        if now >= next_check:
            check()
            if deadline is not None and time.monotonic() >= deadline:
                return False
            next_check = now + wake
    while True:  # a stale ring left in the FIFO costs one extra turn (wait drains it)
        ring.store(flag, 1)
        fence()
        if ready():
            ring.store(flag, 0)
            return True
        wait = wake
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                ring.store(flag, 0)
                return False
            wait = min(wait, left)
        bell.wait(wait)
        ring.store(flag, 0)
        if ready():
            return True
        check()
