"""A memory node process's side of a replica's step mailbox (issue 41, item 3): a thread that
polls the mailbox a MAILBOX message named and answers each SEND through the node
(:class:`~lamina.transport.mailbox.MailboxServer`), under the node's lock. With the node's
native plane (:mod:`lamina.memnode.native`) the poll and the answers run in C++ without the
GIL (:meth:`NativePlane.mailbox_poll <lamina.memnode.native.NativePlane.mailbox_poll>`); a SEND
the C++ path declines is answered by the Python server, the reference.

A SEND may come before its step's PREPARE, which travels on the replica's ring and is handled
by the peer's thread: the node's :class:`~lamina.memnode.node.UnknownStep` is then
:class:`~lamina.transport.mailbox.NotReady`, and the SEND is polled again. Polling: a loop that
owns its core (``spin_us`` infinite) never sleeps, yielding the interpreter between polls so
the peer's thread runs its PREPAREs; otherwise it polls ``spin_us`` after the last answer, then
sleeps ``IDLE_SLEEP_S`` between polls, and after ``DOZE_AFTER_S`` without a SEND it dozes
``DOZE_S`` at a time, woken at once by :meth:`MailboxLoop.wake` (the peer's thread calls it
on each PREPARE: a step is coming).
"""
from __future__ import annotations

import threading
import time
from typing import Any

from lamina.memnode.node import MemoryNode, UnknownStep
from lamina.transport.mailbox import MailboxServer, NotReady, map_shared
from lamina.types import AttendMsg, AttendResult

IDLE_SLEEP_S = 50e-6
DOZE_AFTER_S, DOZE_S = 0.01, 0.001
NATIVE_SPIN_NS = 1_000_000  # a native poll's spin, for a loop that owns its core


class MailboxLoop:
    """Serves node index ``meta["node"]`` of the mailbox ``meta`` names (a MAILBOX message's
    meta: :attr:`SharedMailbox.handle <lamina.transport.mailbox.SharedMailbox.handle>` plus
    ``node``) with ``node`` under ``lock``, on its own thread from :meth:`start` to
    :meth:`stop`."""

    def __init__(self, node: MemoryNode, lock: Any, meta: dict[str, Any], spin_us: float) -> None:
        self.node, self.lock, self.spin_s = node, lock, spin_us * 1e-6
        box = map_shared(meta)
        self.server = MailboxServer(box, int(meta["node"]), self._attend)
        plane = getattr(node, "plane", None)
        self.native = None if plane is None else plane.mailbox_poll(box, self.server.node,
                                                                    self.server.seen)
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name="lamina: step mailbox")

    def start(self) -> "MailboxLoop":
        self._thread.start()
        return self

    def wake(self) -> None:
        """End a doze now (a step is coming)."""
        self._wake.set()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()

    def _attend(self, msg: AttendMsg) -> AttendResult:
        with self.lock:
            try:
                self.node.sync()
                return self.node.attend(msg)
            except UnknownStep as e:
                raise NotReady(str(e)) from e

    def _poll(self) -> bool:
        """Answer what is waiting; whether anything was answered."""
        if self.native is None:
            return self.server.poll()
        forever = self.spin_s == float("inf")  # own core: spin in C++ a while, yielding
        answered, slot = self.native(NATIVE_SPIN_NS if forever else 0, 1 if forever else 0)
        if slot >= 0:
            answered += self.server.answer(slot)  # the C++ path declined it: Python's
        return answered > 0

    def _run(self) -> None:
        last = time.monotonic()
        poll, stopped = self._poll, self._stop.is_set
        while not stopped():
            if poll():
                last = time.monotonic()
                continue
            idle = time.monotonic() - last
            if idle < self.spin_s:
                time.sleep(0)  # yield: the peer's thread may hold a PREPARE
            elif idle < DOZE_AFTER_S:
                time.sleep(IDLE_SLEEP_S)
            elif self._wake.wait(DOZE_S):
                self._wake.clear()
                last = time.monotonic()
