"""Same-host backend: one single-producer/single-consumer byte ring per direction, each in its
own POSIX shared-memory segment (DESIGN.md §5).

Messages are encoded with :mod:`lamina.transport.wire` and *streamed* through the ring: the
writer copies as much as fits and waits for space, the reader copies what is there into a
:class:`~lamina.transport.stream.StreamDecoder`, so a message of any size passes through a ring
of any capacity. Decoded tensors own a fresh buffer (never a view of shared memory).

Segment layout and the ring itself: :mod:`lamina.transport.shm_ring`.

Waiting. A side that finds nothing to do busy-polls for ``spin_us`` microseconds (``inf``: a
receiver that owns its core spins for good, yielding to any runnable thread of its core and
checking the peer every ``wake_interval``), then sets its waiting flag, re-checks, and blocks
on a *doorbell*: a named FIFO (``os.mkfifo``) next to
the segments, which the other side writes one byte to (non-blocking) only when it sees the
flag. The block is a ``poll`` of at most ``wake_interval`` seconds, after which it re-checks
the ring, the closed flags and the peer's liveness, so an idle receiver costs ~0% CPU and a
dead peer is noticed within about ``wake_interval``. Flag/counter ordering uses a lock
acquire/release as a memory fence; the timed wait also bounds any missed wake-up to
``wake_interval``. Both ends open every FIFO read-write and non-blocking (Linux semantics:
opening never blocks, a write never blocks - a full pipe already holds a pending wake-up).

Peer liveness: by default the peer's pid, recorded in the segment when it attached (a zombie
counts as dead); before the peer attached it counts as alive. Pass ``peer_alive=`` (e.g. the
parent's ``process.is_alive``) to decide yourself; this also covers a child that dies before
attaching. Then a blocked ``recv``/``send`` raises :class:`PeerDied`.

Names. Segments and FIFOs are named only until the peer attaches: the attaching end removes
the names right away (both ends keep their mappings and open FIFOs), so nothing is left behind
whichever process is killed later, and a spec can be attached once. If no peer ever attaches,
the creator removes them on ``close()``, when garbage collected or at interpreter exit.

Setup across processes (control plane, not data plane)::

    ch = ShmChannel.create(capacity=8 << 20)             # creates both rings and doorbells
    hand ch.spec to the peer: as spawn arguments, pickled (Ray), or ch.spec.to_dict() as JSON
    peer = ShmChannel.attach(spec)                        # any process of this host and user
    ch.set_peer_alive(proc.is_alive)                      # optional, see above

:class:`ShmChannelSpec` is plain data (names, a directory, a capacity): any process on the host
running as the same user can attach, whether or not it was started by the creator. Attaching
does not register the segments with ``multiprocessing``'s resource tracker (whose exit would
unlink them under the creator). The peer must attach before the creator closes (afterwards
:meth:`ShmChannel.attach` raises :class:`ChannelClosed`). If the creator is killed (SIGKILL,
or SIGTERM without a handler) *before* a peer attached, its segments are unlinked by its
resource tracker when that exits (for a ``multiprocessing`` child: the tracker it shares with
its parent tree), but the (empty) FIFOs stay behind in :attr:`ShmChannelSpec.bell_dir`.
A ring must be used by one process pair only (single producer, single consumer).
"""
from __future__ import annotations

import os
import secrets
import threading
import time
import weakref
from typing import Any, Callable, Sequence

from lamina.transport.base import Channel, ChannelClosed, PeerDied
from lamina.transport.shm_ring import (_HEAD, _R_CLOSED, _R_PID, _R_WAIT, _TAIL, _W_CLOSED,
                                      _W_PID, _W_WAIT, RingSpec, ShmChannelSpec, _Doorbell,
                                      _fence, _pid_alive, _release_rings, _Ring,
                                      default_bell_dir, wait_for)
from lamina.transport import shm_fast
from lamina.transport.wire import (DEFAULT_LIMITS, Buffer, Message, MsgKind, WireError,
                                   WireLimits, decode_kind, decode_meta, encode, encode_meta)
from lamina.transport.stream import StreamDecoder

__all__ = ["RingSpec", "ShmChannelSpec", "ShmChannel", "shm_pair", "default_bell_dir"]

_KINDS = frozenset(int(k) for k in MsgKind)
_EMPTY, _SLOW_PATH = 0, 2  # ring_recv's statuses: nothing there / leave it to the decoder


class ShmChannel(Channel):
    """One end of a shared-memory duplex link. Create with :meth:`create` (side "a", owns the
    segments) and :meth:`attach` (side "b"), or :func:`shm_pair` for both ends in one process.

    ``spin_us``: busy-poll time before blocking. ``wake_interval``: seconds between checks of
    the closed flags and peer liveness while blocked. ``peer_alive``: optional callable
    overriding the pid-based liveness check. ``fast``: the C++ fast path
    (:mod:`lamina.transport.shm_fast`): None uses it when it builds, True requires it, False
    never uses it (both ends may differ: the bytes are the same).
    """

    def __init__(self, spec: ShmChannelSpec, side: str, *, limits: WireLimits = DEFAULT_LIMITS,
                 spin_us: float = 100.0, wake_interval: float = 0.05,
                 peer_alive: Callable[[], bool] | None = None, fast: bool | None = None) -> None:
        if side not in ("a", "b"):
            raise ValueError(f"side must be 'a' or 'b', got {side!r}")
        if wake_interval <= 0 or spin_us < 0:
            raise ValueError("wake_interval must be > 0 and spin_us >= 0")
        self.spec = spec
        self.side = side
        self.limits = limits
        self._spin_s = spin_us * 1e-6
        self._wake = wake_interval
        self._peer_alive_fn = peer_alive
        self._peer_pid = 0
        create = side == "a"
        tx_spec, rx_spec = (spec.a_to_b, spec.b_to_a) if create else (spec.b_to_a, spec.a_to_b)
        self._tx = _Ring(tx_spec, create)
        try:
            self._rx = _Ring(rx_spec, create)
        except BaseException:
            self._tx.release(unlink=create)
            raise
        self._finalizer = weakref.finalize(self, _release_rings, [self._tx, self._rx], create)
        self._tx.ctl[_W_PID] = os.getpid()
        self._rx.ctl[_R_PID] = os.getpid()
        self._tx_head = int(self._tx.ctl[_HEAD])
        self._rx_tail = int(self._rx.ctl[_TAIL])
        self._dec = StreamDecoder(limits)
        self._fast = shm_fast.load() if fast is None or fast else None
        if fast and self._fast is None:
            raise RuntimeError(f"the shm fast path is unavailable "
                               f"({shm_fast.EXTENSION.build_error() or 'LAMINA_KERNELS=torch'})")
        self._recv_limits = limits.as_tuple()  # the decoder's, fixed (as for the slow path)
        self._tx_lock = threading.Lock()
        self._rx_lock = threading.Lock()
        self._close_lock = threading.Lock()
        self._closed = False
        self._named = True  # the names exist (or the creator has not noticed they are gone)
        if not create:  # both ends are mapped: nothing needs the names any more
            self._drop_names()

    # ------------------------------------------------------------------ construction

    @classmethod
    def create(cls, capacity: int = 8 << 20, *, bell_dir: str | None = None,
               **kwargs: Any) -> "ShmChannel":
        """Create both rings (``capacity`` data bytes each) and their doorbell FIFOs (in
        ``bell_dir``, default :func:`default_bell_dir`) and return end "a"; hand
        ``channel.spec`` to the peer, which calls :meth:`attach`."""
        if type(capacity) is not int or capacity < 1:
            raise ValueError(f"capacity must be an int >= 1, got {capacity!r}")
        name = f"lamina_{os.getpid()}_{secrets.token_hex(6)}"
        spec = ShmChannelSpec(name, capacity, os.path.abspath(bell_dir or default_bell_dir()))
        return cls(spec, "a", **kwargs)

    @classmethod
    def attach(cls, spec: ShmChannelSpec | dict[str, Any], **kwargs: Any) -> "ShmChannel":
        """Open end "b" of the link described by ``spec`` (or its :meth:`~ShmChannelSpec.to_dict`)
        in this or any other process of the host."""
        if isinstance(spec, dict):
            spec = ShmChannelSpec.from_dict(spec)
        if not isinstance(spec, ShmChannelSpec):
            raise TypeError(f"expected a ShmChannelSpec, got {type(spec).__name__}")
        return cls(spec, "b", **kwargs)

    def _drop_names(self) -> None:
        """Remove the segments' and FIFOs' names once both ends are attached, so that nothing
        is left behind whichever process is killed later. The attacher does it right after
        attaching; the creator, noticing the peer's pid in the ring, only tidies up its
        resource-tracker registration."""
        with self._close_lock:
            if self._named:
                self._named = False
                for ring in (self._tx, self._rx):
                    if ring.owner_pid == os.getpid():
                        ring.unlink()

    def _peer_attached(self) -> bool:
        return self.side == "b" or bool(self._tx.ctl[_R_PID])

    # ------------------------------------------------------------------ liveness / state

    @property
    def limits(self) -> WireLimits:
        """What this end's sends are checked against (settable; received messages keep the
        limits given at construction)."""
        return self._limits

    @limits.setter
    def limits(self, value: WireLimits) -> None:
        self._limits = value
        self._send_limits = value.as_tuple()

    @property
    def closed(self) -> bool:
        return self._closed

    def set_peer_alive(self, fn: Callable[[], bool] | None) -> None:
        """Install (or with ``None`` remove) the peer-liveness hook."""
        self._peer_alive_fn = fn

    def peer_alive(self) -> bool:
        """Whether the peer is alive: the hook if set, else its recorded pid (unknown = alive)."""
        if self._peer_alive_fn is not None:
            return bool(self._peer_alive_fn())
        if not self._peer_pid and not self._closed:
            self._peer_pid = int(self._tx.ctl[_R_PID])
        pid = self._peer_pid
        return pid in (0, os.getpid()) or _pid_alive(pid)

    # ------------------------------------------------------------------ waiting

    def _wait(self, ring: _Ring, flag: int, bell: _Doorbell, word: int, base: int, need: int,
              check: Callable[[], None], deadline: float | None) -> bool:
        """:func:`~lamina.transport.shm_ring.wait_for` with this end's spin, wake interval and
        fast path."""
        return wait_for(ring, flag, bell, word, base, need, check, deadline,
                        self._spin_s, self._wake, self._fast)

    def _check_rx(self) -> None:
        if self._closed:
            raise ChannelClosed("shm channel is closed")
        if self._named and self._peer_attached():
            self._drop_names()
        if self._rx.ctl[_W_CLOSED]:
            _fence()
            if self._rx.ctl[_HEAD] == self._rx_tail:
                raise ChannelClosed("peer closed the shm channel")
        elif not self.peer_alive():
            _fence()
            if self._rx.ctl[_HEAD] == self._rx_tail:
                raise PeerDied("peer process died (shm channel receive)")

    def _check_tx(self) -> None:
        if self._closed:
            raise ChannelClosed("shm channel is closed")
        if self._named and self._peer_attached():
            self._drop_names()
        if self._tx.ctl[_R_CLOSED]:
            raise ChannelClosed("peer closed the shm channel")
        if not self.peer_alive():
            raise PeerDied("peer process died (shm channel send)")

    # ------------------------------------------------------------------ data path

    def send(self, msg: Message) -> None:
        fast = self._fast
        with self._tx_lock:
            self._check_send()
            if fast is not None and type(msg.kind) in (MsgKind, int) and msg.kind in _KINDS:
                try:
                    head, wake = fast.ring_send(
                        self._tx.ctl_addr, self._tx.data_addr, self._tx.capacity, self._tx_head,
                        int(msg.kind), msg.step_id, msg.layer, msg.reply_to,
                        encode_meta(msg.meta, self.limits), msg.tensors, self._send_limits)
                except (TypeError, RuntimeError):  # e.g. a field out of range: the slow path
                    head, wake = -2, False  # raises the WireError
                if head >= 0:
                    self._tx_head = head
                    if wake:
                        self._tx.data_bell.ring()
                    return
            self._write(encode(msg, self.limits))

    def send_raw(self, buffers: Sequence[Buffer]) -> None:
        """Write bytes to the stream unchecked: for forwarding messages already encoded with
        :func:`~lamina.transport.wire.encode` (and for tests that inject malformed input)."""
        with self._tx_lock:
            self._check_send()
            self._write(buffers)

    def _check_send(self) -> None:
        if self._closed:
            raise ChannelClosed("shm channel is closed")
        if self._tx.ctl[_R_CLOSED]:
            raise ChannelClosed("peer closed the shm channel")
        if self._named and self._peer_attached():
            self._drop_names()

    def _write(self, buffers: Sequence[Buffer]) -> None:
        """Stream ``buffers`` into the ring (the caller holds the send lock), waiting for
        space as needed."""
        ring, cap, ctl, data = self._tx, self._tx.capacity, self._tx.ctl, self._tx.data
        for buf in buffers:
            src = memoryview(buf).cast("B")
            off, total = 0, len(src)
            while off < total:
                if self._closed:  # closed from another thread mid-message
                    raise ChannelClosed("shm channel is closed")
                free = cap - (self._tx_head - ctl[_TAIL])
                if free <= 0:
                    self._wake_reader(ring)  # it must drain the ring before we go on
                    self._wait(ring, _W_WAIT, ring.space_bell, _TAIL, self._tx_head - cap, 1,
                               self._check_tx, None)
                    continue
                _fence()  # the reader's tail store precedes our overwrite
                pos = self._tx_head % cap
                n = min(free, total - off, cap - pos)
                data[pos:pos + n] = src[off:off + n]
                off += n
                self._tx_head += n
                _fence()  # data before head
                ctl[_HEAD] = self._tx_head
        self._wake_reader(ring)  # once per message, not per buffer: fewer wake-ups

    @staticmethod
    def _wake_reader(ring: _Ring) -> None:
        _fence()  # head before reading the reader's waiting flag
        if ring.ctl[_R_WAIT]:
            ring.data_bell.ring()

    def recv(self, timeout: float | None = None) -> Message:
        deadline = None if timeout is None else time.monotonic() + max(timeout, 0.0)
        with self._rx_lock:
            ring, cap, ctl, data = self._rx, self._rx.capacity, self._rx.ctl, self._rx.data
            fast = self._fast
            while True:
                if self._closed:
                    raise ChannelClosed("shm channel is closed")
                if fast is not None and not self._dec.in_progress:
                    got = fast.ring_recv(ring.ctl_addr, ring.data_addr, cap, self._rx_tail,
                                         self._recv_limits)
                    status = got[0]
                    if status > _SLOW_PATH:  # a whole message: got[0] is the tail past it
                        msg = self._accept(got)
                        self._rx_tail = status
                        if fast.ring_commit(ring.ctl_addr, status):
                            ring.space_bell.ring()
                        return msg
                    if status == _EMPTY:
                        if not self._wait(ring, _R_WAIT, ring.data_bell, _HEAD, self._rx_tail,
                                          1, self._check_rx, deadline):
                            raise TimeoutError(f"no message within {timeout} s")
                        continue
                view = self._dec.buffer()  # raises WireError once the stream is corrupt
                avail = ctl[_HEAD] - self._rx_tail
                if avail <= 0:
                    if not self._wait(ring, _R_WAIT, ring.data_bell, _HEAD, self._rx_tail, 1,
                                      self._check_rx, deadline):
                        raise TimeoutError(f"no message within {timeout} s")
                    continue
                _fence()  # head before data
                pos = self._rx_tail % cap
                n = min(avail, len(view), cap - pos)
                view[:n] = data[pos:pos + n]
                view.release()
                self._rx_tail += n
                _fence()  # data read before the writer may reuse it
                ctl[_TAIL] = self._rx_tail
                _fence()  # tail before reading the writer's waiting flag
                if ctl[_W_WAIT]:
                    ring.space_bell.ring()
                msg = self._dec.advance(n)
                if msg is not None:
                    return msg

    def _accept(self, got: tuple) -> Message:
        """The Message of a fast-path read; a bad kind or meta poisons the stream as the
        decoder would (the bytes stay in the ring)."""
        _, _, kind, step_id, layer, reply_to, meta, tensors = got
        try:
            return Message(decode_kind(kind), step_id, layer, reply_to, decode_meta(meta),
                           tensors)
        except WireError as exc:
            self._dec.poison(exc)
            raise

    def close(self) -> None:
        """Close this end: the peer's blocked calls raise ChannelClosed (after draining what was
        sent), this end's blocked calls are woken, and the creator unlinks the segments."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        self._tx.ctl[_W_CLOSED] = 1
        self._rx.ctl[_R_CLOSED] = 1
        _fence()
        for bell in (self._tx.data_bell, self._rx.space_bell,  # wake the peer
                     self._rx.data_bell, self._tx.space_bell):  # wake our own threads
            bell.ring()
        limit = 5.0 + 2 * self._wake
        got_tx = self._tx_lock.acquire(timeout=limit)
        got_rx = self._rx_lock.acquire(timeout=limit)
        try:
            if got_tx and got_rx:
                self._finalizer()
            elif self.side == "a":  # a thread is still inside: keep the mapping, drop the names
                with self._close_lock:
                    self._named = False
                    for ring in (self._tx, self._rx):
                        if os.getpid() == ring.owner_pid:
                            ring.unlink()
        finally:
            if got_tx:
                self._tx_lock.release()
            if got_rx:
                self._rx_lock.release()


def shm_pair(capacity: int = 8 << 20, **kwargs: Any) -> tuple[ShmChannel, ShmChannel]:
    """Both ends of a shared-memory link in this process (for tests and threads)."""
    a = ShmChannel.create(capacity, **kwargs)
    try:
        return a, ShmChannel.attach(a.spec, **kwargs)
    except BaseException:
        a.close()
        raise
