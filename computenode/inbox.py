"""Where a replica process's main thread takes its next message from (:class:`Inbox`).

Links whose receive side is a shared-memory ring (the engine's, the memory nodes') are received
on by the main thread itself: one native wait (:class:`~lamina.transport.waitset.WaitSet`) over
those rings and a post counter, so a RESULT wakes the thread that merges it. Every other link
(tcp, the previous replica's contexts) has a reader thread that puts its messages into a queue
and posts. A link's end arrives as ``(source, the exception)``, unless the link was replaced on
purpose (its role restarted): ``current(source, link)`` says whether a link is still its
source's.
"""
from __future__ import annotations

import queue
import threading
from typing import Any, Callable

from lamina.transport import shm_fast
from lamina.transport.endpoint import Listening
from lamina.transport.waitset import TIMED_OUT, WaitSet

WAKE_S = 0.05  # the main thread checks the links it waits on at least this often


class Inbox:
    """The messages of a replica's links, for one consumer thread (see the module docstring).
    ``idle_spin_us``: how long a wait polls before sleeping. ``direct``/``rings``: the links
    received on here and their wait handles (a caller may wait on one alone: ``waits``);
    ``spin``: the poll settings of such a wait."""

    def __init__(self, idle_spin_us: float, current: Callable[[Any, Any], bool]) -> None:
        self.queue: queue.SimpleQueue = queue.SimpleQueue()  # C-level put/get: on the hot path
        fast = shm_fast.load()
        self.waits = WaitSet(fast, idle_spin_us) if fast is not None else None
        self.direct: list[tuple[Any, Any]] = []  # (source, channel) received on here
        self.rings: list[tuple[int, int, int]] = []  # their wait handles
        self.spin = self.waits.spin(WAKE_S) if self.waits is not None else (0, 0)
        self._current = current

    def add(self, source: Any, ch) -> None:
        """Receive ``ch``'s messages on the consumer's thread where the channel allows, else
        with a reader thread."""
        handle = ch.wait_handle() if self.waits is not None else None
        if handle is None:
            self.read(source, ch)
        else:
            self.direct.append((source, ch))
            self.rings.append(handle)

    def read(self, source: Any, ch) -> None:
        """A reader thread puts every message of ``ch`` (a channel, or a :class:`Listening`
        whose peer has yet to join) into the queue, then the error that ended it."""
        origin = ch

        def loop() -> None:
            try:
                nonlocal ch
                if isinstance(ch, Listening):
                    ch = ch.channel()
                while True:
                    self.put(source, ch.recv())
            except BaseException as e:  # noqa: BLE001 - reported to the consumer
                if self._current(source, origin):  # else: a replaced link, ended on purpose
                    self.put(source, e)
        threading.Thread(target=loop, daemon=True, name=f"reader-{source}").start()

    def put(self, source: Any, item: Any) -> None:
        self.queue.put((source, item))
        if self.waits is not None:
            self.waits.post()

    def take(self) -> tuple[Any, Any]:
        """The next ``(source, message or the error that ended its link)``: the queue's, or
        one from a ring received on here, waiting on both at once."""
        while True:
            seen = self.waits.posted if self.direct else 0
            try:
                return self.queue.get_nowait()
            except queue.Empty:
                if not self.direct:
                    return self.queue.get()
            got = self.waits.wait(self.rings, seen, WAKE_S)
            if got >= 0:
                source, ch = self.direct[got]
                try:
                    return source, ch.recv()
                except BaseException as e:  # noqa: BLE001 - as a reader thread reports it
                    self.forget(got)
                    return source, e
            if got == TIMED_OUT:  # check the peers, as a receive does every wake interval
                for i, (source, ch) in enumerate(self.direct):
                    try:
                        ch.check_peer()
                    except BaseException as e:  # noqa: BLE001
                        self.forget(i)
                        return source, e

    def pending(self, but: int) -> bool:
        """Whether a message waits anywhere but on direct link ``but``: in the queue (a reader
        thread's) or on another direct ring (one look, no wait). A thread about to wait on
        link ``but`` alone must not while this holds: what waits elsewhere may be work it could
        run meanwhile (another micro-batch's step)."""
        return not self.queue.empty() or (
            self.waits is not None and self.waits.ready(self.rings[:but] + self.rings[but + 1:]))

    def drain(self) -> None:
        """Move every whole message now waiting on the direct links into the queue (and
        post), for :meth:`take` to hand out in order later: what a thread blocked writing to
        a peer calls, so that the peer, blocked writing to it, can go on."""
        for i in range(len(self.direct) - 1, -1, -1):
            source, ch = self.direct[i]
            while self.waits.ready([self.rings[i]]):
                try:
                    self.put(source, ch.recv())
                except BaseException as e:  # noqa: BLE001 - as take reports it
                    self.forget(i)
                    self.put(source, e)
                    break

    def forget(self, i: int) -> None:
        """Stop receiving on direct link ``i``."""
        del self.direct[i], self.rings[i]

    def drop(self, source: Any) -> None:
        """Stop receiving ``source``'s direct link (its role is being replaced)."""
        for i in [i for i, (s, _) in enumerate(self.direct) if s == source][::-1]:
            self.forget(i)

    def index(self, source: Any) -> int:
        """The direct link of ``source`` (-1: none: it is read by a thread, or gone)."""
        return next((i for i, (s, _) in enumerate(self.direct) if s == source), -1)
