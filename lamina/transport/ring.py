"""The one-sided ring protocol every byte-ring link speaks (shared memory today, RDMA where a
device exists), over the memory primitive :class:`~lamina.transport.ring_memory.RingMemory`:
one single-producer/single-consumer byte ring per direction, messages encoded by
:mod:`lamina.transport.wire` and streamed through it (any size through any capacity), the C++
fast path of :mod:`lamina.transport.shm_fast` first where it takes the message. The protocol,
the primitive and the fast path's statuses: docs/architecture.md, "The ring protocol".
"""
from __future__ import annotations

import threading
import time
from functools import partial
from abc import abstractmethod
from types import SimpleNamespace
from typing import Any, Callable, Sequence

from lamina.transport.base import Channel, ChannelClosed, PeerDied
from lamina.transport.ring_memory import (HEAD, R_CLOSED, R_WAIT, TAIL, W_CLOSED, W_WAIT, YIELD_EVERY,
                                          Bell, RingMemory, fence, wait_for)
from lamina.transport.ring_native import NativeEnd
from lamina.transport.shm_fast import EMPTY, HELD, SENT, SENT_WAKE, STREAM, TAKEN, TAKEN_WAKE
from lamina.transport.stream import StreamDecoder
from lamina.transport.wire import (DEFAULT_LIMITS, Buffer, Message, MsgKind, WireError, WireLimits,
                                   decode_kind, decode_meta, encode, encode_meta)

_KINDS = frozenset(int(k) for k in MsgKind)
FULL_POLL_S = 1e-3  # how often a send waiting for room calls its while_full
_KIND_TYPES = (MsgKind, int)  # a kind of another type goes to the Python encoder (which refuses it)


class RingChannel(NativeEnd, Channel):
    """One end of a duplex link of two rings (``tx`` written here, ``rx`` read here) speaking
    the protocol of this module. Subclasses set up the memory and say whether the peer lives
    (:meth:`peer_alive`), and may tidy up on every liveness check (:meth:`_on_check`) and at
    close (:meth:`_release`).

    ``spin_us``: busy-poll time before blocking. ``wake_interval``: seconds between checks of
    the closed flags and peer liveness while blocked. ``fast``: the C++ fast path module, or
    None for the Python path."""

    def __init__(self, tx: RingMemory, rx: RingMemory, *, limits: WireLimits = DEFAULT_LIMITS,
                 spin_us: float = 100.0, wake_interval: float = 0.05, fast: Any = None) -> None:
        if wake_interval <= 0 or spin_us < 0:
            raise ValueError("wake_interval must be > 0 and spin_us >= 0")
        self._tx, self._rx = tx, rx
        self.limits = limits
        self._spin_s, self._wake = spin_us * 1e-6, wake_interval
        self._forever = spin_us == float("inf")  # a receiver that owns its core: never sleeps
        self._yield_every = YIELD_EVERY if self._forever else 0  # per fast receive call
        self._spin_ns = int(min(self._spin_s, wake_interval) * 1e9)  # per fast receive call
        self._wake_ns = int(wake_interval * 1e9)
        # a receiver that may sleep does so inside the fast receive call, on the data doorbell
        # when it has an fd (shm's FIFO); else (RDMA: polls only) in _idle
        self._sleep_bell = -1 if self._forever else getattr(rx.data_bell, "fd", -1)
        self._dec, self._fast = StreamDecoder(limits), fast
        # this end's counts (HEAD of tx, TAIL of rx) live in the fast path's ring ends, which
        # the Python path reads and moves too; without it, in plain stand-ins
        self._writer = self._reader = None
        if fast is not None:
            self._writer = fast.Writer(tx.ctl_addr, tx.data_addr, tx.capacity, int(tx.ctl[HEAD]),
                                       self._send_limits, sorted(_KINDS))
            self._reader = fast.Reader(rx.ctl_addr, rx.data_addr, rx.capacity, int(rx.ctl[TAIL]),
                                       limits.as_tuple(),  # the decoder's limits, fixed
                                       {int(k): k for k in MsgKind}, Message)
        self._exchange = None  # the native exchange, bound to this end (fast path, unmirrored)
        if fast is not None and not tx.mirrored and not rx.mirrored:
            self._exchange = partial(fast.exchange, self._writer, self._reader,
                                     getattr(tx.data_bell, "fd", -1), self._sleep_bell,
                                     self._wake_ns, getattr(rx.space_bell, "fd", -1))
        self._tx_end = self._writer or SimpleNamespace(head=int(tx.ctl[HEAD]))
        self._rx_end = self._reader or SimpleNamespace(tail=int(rx.ctl[TAIL]))
        self._tx_lock, self._rx_lock, self._close_lock = (threading.Lock() for _ in range(3))
        self._closed = False

    # ------------------------------------------------------------------ hooks
    @abstractmethod
    def peer_alive(self) -> bool:
        """Whether the other end still runs."""

    def _on_check(self) -> None:  # noqa: B027 - optional
        """Runs at every liveness check (shm: drop the names once the peer attached)."""

    def _release(self) -> None:  # noqa: B027 - optional
        """Runs once at close when no thread is inside a send or receive."""

    def _release_busy(self) -> None:  # noqa: B027 - optional
        """Runs at close instead of :meth:`_release` when a thread is still inside."""

    # ------------------------------------------------------------------ state
    @property
    def limits(self) -> WireLimits:
        """What this end's sends are checked against (settable; received messages keep the
        limits given at construction)."""
        return self._limits

    @limits.setter
    def limits(self, value: WireLimits) -> None:
        self._limits = value
        self._send_limits = value.as_tuple()
        if getattr(self, "_writer", None) is not None:
            self._writer.set_limits(self._send_limits)

    @property
    def closed(self) -> bool:
        return self._closed

    # ------------------------------------------------------------------ waiting
    def _wait(self, ring: RingMemory, flag: int, bell: Bell, word: int, base: int, need: int,
              check: Callable[[], None], deadline: float | None, spin_s: float | None = None) -> bool:
        return wait_for(ring, flag, bell, word, base, need, check, deadline,
                        self._spin_s if spin_s is None else spin_s, self._wake, self._fast)

    def _check_rx(self) -> None:
        if self._closed:
            raise ChannelClosed("channel is closed")
        self._on_check()
        if self._rx.ctl[W_CLOSED]:
            fence()
            if self._rx.ctl[HEAD] == self._rx_end.tail:
                raise ChannelClosed("peer closed the channel")
        elif not self.peer_alive():
            fence()
            if self._rx.ctl[HEAD] == self._rx_end.tail:
                raise PeerDied("peer process died (channel receive)")

    def _check_tx(self) -> None:
        if self._closed:
            raise ChannelClosed("channel is closed")
        self._on_check()
        if self._tx.ctl[R_CLOSED]:
            raise ChannelClosed("peer closed the channel")
        if not self.peer_alive():
            raise PeerDied("peer process died (channel send)")

    # ------------------------------------------------------------------ data path
    def send(self, msg: Message, while_full: Callable[[], None] | None = None) -> None:
        """Send ``msg``, waiting for ring space as needed. ``while_full``: called (about every
        millisecond) while the ring has no room, for a caller that must keep taking its own
        messages in meanwhile: two ends that each block writing into a full ring, neither
        reading, wait for each other forever."""
        writer, ring = self._writer, self._tx
        with self._tx_lock:
            if self._closed:
                raise ChannelClosed("channel is closed")
            status, head = None, 0  # None: the Python path
            if writer is not None and type(msg.kind) in _KIND_TYPES:  # Writer checks the kind
                meta = msg.meta
                meta = b"" if type(meta) is dict and not meta else encode_meta(meta, self.limits)
                head = writer.head if ring.mirrored else 0
                status = writer.send(int(msg.kind), msg.step_id, msg.layer, msg.reply_to, meta,
                                     msg.tensors)
            if status == SENT or status == SENT_WAKE:
                if ring.mirrored:  # the fast path wrote the local copy only
                    ring.publish(head, writer.head)
                    ring.store(HEAD, writer.head)
                if status == SENT_WAKE:  # the reader sleeps
                    ring.data_bell.ring()
                return
            # NO_ROOM: streamed below; INELIGIBLE: encoded (or refused with the precise
            # WireError) below; PEER_CLOSED: _check_send raises
            self._check_send()
            self._write(encode(msg, self.limits), while_full)

    def send_raw(self, buffers: Sequence[Buffer]) -> None:
        """Write bytes to the stream unchecked: for forwarding messages already encoded with
        :func:`~lamina.transport.wire.encode` (and for tests that inject malformed input)."""
        with self._tx_lock:
            self._check_send()
            self._write(buffers)

    def _check_send(self) -> None:
        if self._closed:
            raise ChannelClosed("channel is closed")
        if self._tx.ctl[R_CLOSED]:
            raise ChannelClosed("peer closed the channel")
        self._on_check()

    def _write(self, buffers: Sequence[Buffer],
               while_full: Callable[[], None] | None = None) -> None:
        """Stream ``buffers`` into the ring (the caller holds the send lock), waiting for
        space as needed (calling ``while_full`` meanwhile, see :meth:`send`)."""
        ring, cap, ctl, data = self._tx, self._tx.capacity, self._tx.ctl, self._tx.data
        for buf in buffers:
            src = memoryview(buf).cast("B")
            off, total = 0, len(src)
            while off < total:
                if self._closed:  # closed from another thread mid-message
                    raise ChannelClosed("channel is closed")
                free = cap - (self._tx_end.head - ctl[TAIL])
                if free <= 0:
                    self._wake_reader(ring)  # it must drain the ring before we go on
                    if while_full is not None:
                        while_full()
                    self._wait(ring, W_WAIT, ring.space_bell, TAIL, self._tx_end.head - cap, 1,
                               self._check_tx,
                               None if while_full is None else time.monotonic() + FULL_POLL_S,
                               None if while_full is None else FULL_POLL_S / 2)
                    continue
                fence()  # the reader's tail store precedes our overwrite
                pos = self._tx_end.head % cap
                n = min(free, total - off, cap - pos)
                data[pos:pos + n] = src[off:off + n]
                ring.publish(self._tx_end.head, self._tx_end.head + n)
                off += n
                self._tx_end.head += n
                fence()  # data before head
                ring.store(HEAD, self._tx_end.head)
        self._wake_reader(ring)  # once per message, not per buffer: fewer wake-ups

    @staticmethod
    def _wake_reader(ring: RingMemory) -> None:
        fence()  # head before reading the reader's waiting flag
        if ring.ctl[R_WAIT]:
            ring.data_bell.ring()

    def recv(self, timeout: float | None = None) -> Message:
        deadline = None if timeout is None else time.monotonic() + max(timeout, 0.0)
        with self._rx_lock:
            ring, reader = self._rx, self._reader
            while reader is not None and not self._dec.in_progress:  # the fast path
                if self._closed:
                    raise ChannelClosed("channel is closed")
                # one call: spin (no GIL) up to the spin time or the next liveness check
                left = self._wake_ns if deadline is None else \
                    max(0, int((deadline - time.monotonic()) * 1e9))
                status, got = reader.recv(min(self._spin_ns, left), self._yield_every,
                                          self._sleep_bell, min(self._wake_ns, left))
                if status == HELD:  # its meta must parse before its bytes go
                    got = self._accept(*got)
                    status = reader.commit()
                if status == TAKEN or status == TAKEN_WAKE:
                    if ring.mirrored:
                        ring.store(TAIL, reader.tail)
                    if status == TAKEN_WAKE:  # the writer waits for space
                        ring.space_bell.ring()
                    return got
                if status == STREAM:  # not whole yet, malformed, too big: the decoder's
                    break
                if self._sleep_bell >= 0:  # EMPTY after a sleep: check, then sleep again
                    self._check_rx()
                    if deadline is not None and time.monotonic() >= deadline:
                        raise TimeoutError(f"no message within {timeout} s")
                else:
                    self._idle(deadline, timeout)  # EMPTY: the spin is spent
            return self._stream_in(deadline, timeout)

    def exchange(self, kind: MsgKind, step_id: int, layer: int, reply_to: int, tensors: list,
                 reply: MsgKind, spin_ns: int, yield_every: int) -> tuple[int, list | None]:
        """Send a message without meta (as :meth:`send`) and take its reply if that is the next
        message to arrive within one wait: kind ``reply``, the same step and layer, no meta.
        Returns ``(sent_ns, the reply's tensors)``, or ``(sent_ns, None)``: the message is sent,
        and what comes next (the reply too, once it is here) is :meth:`recv`'s. The wait polls
        ``spin_ns`` (``yield_every`` as in :class:`~lamina.transport.waitset.WaitSet`), then
        sleeps as this end's receives do, for one wake interval at most. One native call on the
        fast path, holding both locks (its caller is this end's only receiver). ``sent_ns``:
        ``time.perf_counter_ns()`` once the message was in the ring. Raises as :meth:`send`."""
        if self._exchange is not None:
            with self._tx_lock, self._rx_lock:
                if not self._closed and not self._dec.in_progress:
                    status, sent_ns, got = self._exchange(step_id, layer, reply_to, tensors, kind,
                                                          reply, spin_ns, yield_every)
                    if status >= EMPTY:  # sent (EMPTY, STREAM or TAKEN)
                        return sent_ns, got
        self.send(Message(kind, step_id, layer, reply_to, tensors=tensors))
        return time.perf_counter_ns(), None

    def check_peer(self) -> None:
        with self._rx_lock:
            self._check_rx()

    def wait_readable(self) -> None:
        """Return once a byte is there to read (after checking the peer: a receiver that spins
        for good returns at once), sleeping on the doorbell otherwise; raises as :meth:`recv`."""
        with self._rx_lock:
            if self._closed:
                raise ChannelClosed("channel is closed")
            if self._rx.ctl[HEAD] == self._rx_end.tail:
                self._idle(None, None)

    def _idle(self, deadline: float | None, timeout: float | None) -> None:
        """After a fast receive found nothing: check the peer (a receiver spinning for good)
        or block until data arrives; TimeoutError once ``deadline`` passed."""
        ring = self._rx
        if self._forever:
            self._check_rx()
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"no message within {timeout} s")
        elif not self._wait(ring, R_WAIT, ring.data_bell, HEAD, self._rx_end.tail, 1,
                            self._check_rx, deadline, spin_s=0.0):
            raise TimeoutError(f"no message within {timeout} s")

    def _stream_in(self, deadline: float | None, timeout: float | None) -> Message:
        """The Python path of :meth:`recv` (the caller holds the receive lock): feed the ring's
        bytes to the stream decoder, waiting for more as needed, until it completes a message."""
        ring = self._rx
        cap, ctl, data = ring.capacity, ring.ctl, ring.data
        while True:
            if self._closed:
                raise ChannelClosed("channel is closed")
            view = self._dec.buffer()  # raises WireError once the stream is corrupt
            avail = ctl[HEAD] - self._rx_end.tail
            if avail <= 0:
                if not self._wait(ring, R_WAIT, ring.data_bell, HEAD, self._rx_end.tail, 1,
                                  self._check_rx, deadline):
                    raise TimeoutError(f"no message within {timeout} s")
                continue
            fence()  # head before data
            pos = self._rx_end.tail % cap
            n = min(avail, len(view), cap - pos)
            view[:n] = data[pos:pos + n]
            view.release()
            self._rx_end.tail += n
            fence()  # data read before the writer may reuse it
            ring.store(TAIL, self._rx_end.tail)
            fence()  # tail before reading the writer's waiting flag
            if ctl[W_WAIT]:
                ring.space_bell.ring()
            msg = self._dec.advance(n)
            if msg is not None:
                return msg

    def _accept(self, kind: int, step_id: int, layer: int, reply_to: int, meta: bytes,
                tensors: list) -> Message:
        """The Message of a fast-path read; a bad meta poisons the stream as the decoder would
        (the bytes stay in the ring)."""
        try:
            return Message(decode_kind(kind), step_id, layer, reply_to, decode_meta(meta),
                           tensors)
        except WireError as exc:
            self._dec.poison(exc)
            raise

    def close(self) -> None:
        """Close this end: the peer's blocked calls raise ChannelClosed (after draining what was
        sent), this end's blocked calls are woken, then :meth:`_release` (or, when a thread is
        still inside after ``5 s + 2 wake intervals``, :meth:`_release_busy`)."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        try:
            self._tx.store(W_CLOSED, 1)
            self._rx.store(R_CLOSED, 1)
        except PeerDied:  # a mirrored memory whose peer is gone: nobody left to tell
            pass
        fence()
        for bell in (self._tx.data_bell, self._rx.space_bell,  # wake the peer
                     self._rx.data_bell, self._tx.space_bell):  # wake our own threads
            bell.ring()
        limit = 5.0 + 2 * self._wake
        got_tx = self._tx_lock.acquire(timeout=limit)
        got_rx = self._rx_lock.acquire(timeout=limit)
        try:
            if got_tx and got_rx:
                self._release()
            else:
                self._release_busy()
        finally:
            if got_tx:
                self._tx_lock.release()
            if got_rx:
                self._rx_lock.release()
