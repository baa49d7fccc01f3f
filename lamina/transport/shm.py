"""Same-host backend: one single-producer/single-consumer byte ring per direction, each in its
own ``multiprocessing.shared_memory.SharedMemory`` segment (DESIGN.md §5).

Messages are encoded with :mod:`lamina.transport.wire` and *streamed* through the ring: the
writer copies as much as fits and waits for space, the reader copies what is there into a
:class:`~lamina.transport.wire.StreamDecoder`, so a message of any size passes through a ring
of any capacity. Decoded tensors own a fresh buffer (never a view of shared memory).

Segment layout: a 4096-byte control block of u64 words (each on its own 64-byte line) then
``capacity`` data bytes. ``head``/``tail`` count bytes written/consumed since creation (the
writer owns ``head``, the reader ``tail``; position = count % capacity); each side's
"waiting" flag, "closed" flag and pid live there too.

Waiting. A side that finds nothing to do busy-polls for ``spin_us`` microseconds, then sets
its waiting flag, re-checks, and blocks on a doorbell (a spawn-context
``multiprocessing.Semaphore``) that the other side releases only when it sees the flag. The
block is a timed wait of ``wake_interval`` seconds, after which it re-checks the ring, the
closed flags and the peer's liveness, so an idle receiver costs ~0% CPU and a dead peer is
noticed within about ``wake_interval``. Flag/counter ordering uses a lock acquire/release as
a memory fence; the timed wait also bounds any missed wake-up to ``wake_interval``.

Peer liveness: by default the peer's pid, recorded in the segment when it attached (a zombie
counts as dead); before the peer attached it counts as alive. Pass ``peer_alive=`` (e.g. the
parent's ``process.is_alive``) to decide yourself; this also covers a child that dies before
attaching. Then a blocked ``recv``/``send`` raises :class:`PeerDied`.

Setup across processes (control plane, not data plane)::

    ch = ShmChannel.create(capacity=8 << 20)             # parent: creates both rings
    p = multiprocessing.get_context("spawn").Process(target=serve, args=(ch.spec,))
    p.start(); ch.set_peer_alive(p.is_alive)
    ...                                                   # child: serve(spec) does
    peer = ShmChannel.attach(spec)                        #   peer = ShmChannel.attach(spec)

The spec holds the segment names and four semaphores; it can be passed as spawn ``Process``
arguments (or inherited over fork) but not sent later through a queue. The creator unlinks the
segments on ``close()`` (or when garbage collected / at exit); the child must attach before
that. A ring must be used by one process pair only (single producer, single consumer).
"""
from __future__ import annotations

import multiprocessing
import os
import secrets
import threading
import time
import weakref
from dataclasses import dataclass
from multiprocessing.shared_memory import SharedMemory
from typing import Any, Callable, Sequence

from lamina.transport.base import Channel, ChannelClosed, PeerDied
from lamina.transport.wire import (DEFAULT_LIMITS, Buffer, Message, StreamDecoder, WireLimits,
                                   encode)

__all__ = ["RingSpec", "ShmChannelSpec", "ShmChannel", "shm_pair"]

_CTL_BYTES = 4096
# control words (u64 index; x8 = byte offset): one 64-byte line each
_HEAD, _TAIL, _R_WAIT, _W_WAIT, _W_CLOSED, _R_CLOSED, _W_PID, _R_PID, _MAGIC, _CAP = \
    0, 8, 16, 24, 32, 40, 48, 56, 64, 72
_RING_MAGIC = int.from_bytes(b"LMNARING", "little")
_SPAWN = multiprocessing.get_context("spawn")
_FENCE_LOCK = threading.Lock()


def _fence() -> None:
    """Full memory barrier (a locked read-modify-write inside the lock implementation)."""
    _FENCE_LOCK.acquire()
    _FENCE_LOCK.release()


def _pid_alive(pid: int) -> bool:
    """True unless process ``pid`` is gone or a zombie (Linux /proc; kill(0) elsewhere)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        return stat[stat.rindex(b")") + 2:][:1] not in (b"Z", b"X", b"x")
    except FileNotFoundError:
        return False
    except (OSError, ValueError):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True


@dataclass(frozen=True)
class RingSpec:
    """One direction: shared-memory segment name, data capacity and its two doorbells."""

    name: str
    capacity: int
    data_bell: Any  # released by the writer when the reader sleeps waiting for data
    space_bell: Any  # released by the reader when the writer sleeps waiting for space


@dataclass(frozen=True)
class ShmChannelSpec:
    """Everything a peer needs to attach: side "a" (the creator) writes ``a_to_b``."""

    a_to_b: RingSpec
    b_to_a: RingSpec


class _Ring:
    """A mapped ring segment: ``ctl`` (u64 control words) and ``data`` (bytes)."""

    def __init__(self, spec: RingSpec, create: bool) -> None:
        self.spec = spec
        self.capacity = spec.capacity
        self.data_bell = spec.data_bell
        self.space_bell = spec.space_bell
        if create:
            self.shm = SharedMemory(name=spec.name, create=True, size=_CTL_BYTES + spec.capacity)
        else:
            try:
                self.shm = SharedMemory(name=spec.name)
            except FileNotFoundError:
                raise ChannelClosed(f"shared memory {spec.name!r} is gone (creator closed)") from None
        self.ctl = self.shm.buf[:_CTL_BYTES].cast("Q")
        self.data = self.shm.buf[_CTL_BYTES:_CTL_BYTES + spec.capacity]
        if create:  # a new segment is zero-filled
            self.ctl[_CAP] = spec.capacity
            self.ctl[_MAGIC] = _RING_MAGIC
        elif self.ctl[_MAGIC] != _RING_MAGIC or self.ctl[_CAP] != spec.capacity:
            self.release(unlink=False)
            raise ValueError(f"{spec.name!r} is not a Lamina ring of capacity {spec.capacity}")

    def release(self, unlink: bool) -> None:
        """Unmap (when no view is alive) and, for the creator, unlink the segment."""
        self.ctl.release()
        self.data.release()
        try:
            self.shm.close()
        except BufferError:  # a stray view is alive; the mapping goes with the process
            pass
        if unlink:
            try:
                self.shm.unlink()
            except FileNotFoundError:
                pass


def _release_rings(rings: list[_Ring], unlink: bool) -> None:
    for ring in rings:
        ring.release(unlink)


class ShmChannel(Channel):
    """One end of a shared-memory duplex link. Create with :meth:`create` (side "a", owns the
    segments) and :meth:`attach` (side "b"), or :func:`shm_pair` for both ends in one process.

    ``spin_us``: busy-poll time before blocking. ``wake_interval``: seconds between checks of
    the closed flags and peer liveness while blocked. ``peer_alive``: optional callable
    overriding the pid-based liveness check.
    """

    def __init__(self, spec: ShmChannelSpec, side: str, *, limits: WireLimits = DEFAULT_LIMITS,
                 spin_us: float = 100.0, wake_interval: float = 0.05,
                 peer_alive: Callable[[], bool] | None = None) -> None:
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
        self._tx_lock = threading.Lock()
        self._rx_lock = threading.Lock()
        self._close_lock = threading.Lock()
        self._closed = False

    # ------------------------------------------------------------------ construction

    @classmethod
    def create(cls, capacity: int = 8 << 20, **kwargs: Any) -> "ShmChannel":
        """Create both rings (``capacity`` data bytes each) and return end "a"; hand
        ``channel.spec`` to the peer, which calls :meth:`attach`."""
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        base = f"lamina_{os.getpid()}_{secrets.token_hex(6)}"
        spec = ShmChannelSpec(
            RingSpec(base + "_ab", capacity, _SPAWN.Semaphore(0), _SPAWN.Semaphore(0)),
            RingSpec(base + "_ba", capacity, _SPAWN.Semaphore(0), _SPAWN.Semaphore(0)))
        return cls(spec, "a", **kwargs)

    @classmethod
    def attach(cls, spec: ShmChannelSpec, **kwargs: Any) -> "ShmChannel":
        """Open end "b" of the link described by ``spec`` (in this or another process)."""
        return cls(spec, "b", **kwargs)

    # ------------------------------------------------------------------ liveness / state

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

    def _wait(self, ring: _Ring, flag: int, bell: Any, ready: Callable[[], bool],
              check: Callable[[], None], deadline: float | None) -> bool:
        """Spin, then block on ``bell`` until ``ready()``; False when ``deadline`` passed.
        ``check()`` runs after each timed wake and raises to abort (closed / peer died)."""
        if ready():
            return True
        spin_end = time.perf_counter() + self._spin_s
        while time.perf_counter() < spin_end:
            if ready():
                return True
        while True:
            while bell.acquire(False):  # drop stale rings before announcing we sleep
                pass
            ring.ctl[flag] = 1
            _fence()
            if ready():
                ring.ctl[flag] = 0
                return True
            wait = self._wake
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    ring.ctl[flag] = 0
                    return False
                wait = min(wait, left)
            bell.acquire(timeout=wait)
            ring.ctl[flag] = 0
            if ready():
                return True
            check()

    def _check_rx(self) -> None:
        if self._closed:
            raise ChannelClosed("shm channel is closed")
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
        if self._tx.ctl[_R_CLOSED]:
            raise ChannelClosed("peer closed the shm channel")
        if not self.peer_alive():
            raise PeerDied("peer process died (shm channel send)")

    # ------------------------------------------------------------------ data path

    def send(self, msg: Message) -> None:
        self.send_raw(encode(msg, self.limits))

    def send_raw(self, buffers: Sequence[Buffer]) -> None:
        """Write bytes to the stream unchecked: for forwarding messages already encoded with
        :func:`~lamina.transport.wire.encode` (and for tests that inject malformed input)."""
        with self._tx_lock:
            if self._closed:
                raise ChannelClosed("shm channel is closed")
            if self._tx.ctl[_R_CLOSED]:
                raise ChannelClosed("peer closed the shm channel")
            ring, cap, ctl, data = self._tx, self._tx.capacity, self._tx.ctl, self._tx.data
            def has_space() -> bool:
                return self._tx_head - ctl[_TAIL] < cap
            for buf in buffers:
                src = memoryview(buf).cast("B")
                off, total = 0, len(src)
                while off < total:
                    free = cap - (self._tx_head - ctl[_TAIL])
                    if free <= 0:
                        self._wait(ring, _W_WAIT, ring.space_bell, has_space, self._check_tx, None)
                        continue
                    _fence()  # the reader's tail store precedes our overwrite
                    pos = self._tx_head % cap
                    n = min(free, total - off, cap - pos)
                    data[pos:pos + n] = src[off:off + n]
                    off += n
                    self._tx_head += n
                    _fence()  # data before head
                    ctl[_HEAD] = self._tx_head
                    _fence()  # head before reading the reader's waiting flag
                    if ctl[_R_WAIT]:
                        ring.data_bell.release()

    def recv(self, timeout: float | None = None) -> Message:
        deadline = None if timeout is None else time.monotonic() + max(timeout, 0.0)
        with self._rx_lock:
            ring, cap, ctl, data = self._rx, self._rx.capacity, self._rx.ctl, self._rx.data
            def has_data() -> bool:
                return ctl[_HEAD] != self._rx_tail
            while True:
                if self._closed:
                    raise ChannelClosed("shm channel is closed")
                view = self._dec.buffer()  # raises WireError once the stream is corrupt
                avail = ctl[_HEAD] - self._rx_tail
                if avail <= 0:
                    if not self._wait(ring, _R_WAIT, ring.data_bell, has_data, self._check_rx,
                                      deadline):
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
                    ring.space_bell.release()
                msg = self._dec.advance(n)
                if msg is not None:
                    return msg

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
            bell.release()
        limit = 5.0 + 2 * self._wake
        got_tx = self._tx_lock.acquire(timeout=limit)
        got_rx = self._rx_lock.acquire(timeout=limit)
        try:
            if got_tx and got_rx:
                self._finalizer()
            elif self.side == "a":  # a thread is still inside: keep the mapping, drop the names
                for ring in (self._tx, self._rx):
                    try:
                        ring.shm.unlink()
                    except FileNotFoundError:
                        pass
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
