"""Same-host backend: one single-producer/single-consumer byte ring per direction, each in its
own POSIX shared-memory segment.

The ring protocol (streaming, head/tail, waiting flags, the C++ fast path) is
:class:`lamina.transport.ring.RingChannel`; this module is its shared-memory memory: both ends
map the same segment, so the protocol's ``store``/``publish`` are plain stores. Decoded
tensors own a fresh buffer (never a view of shared memory). Segments and doorbells:
:mod:`lamina.transport.shm_ring`.

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
import weakref
from typing import Any, Callable

from lamina.transport import shm_fast
from lamina.transport.ring import RingChannel
from lamina.transport.ring_memory import R_PID, W_PID
from lamina.transport.shm_ring import (ShmChannelSpec, RingSpec, _pid_alive, _release_rings, _Ring,
                                      default_bell_dir)
from lamina.transport.wire import DEFAULT_LIMITS, WireLimits

__all__ = ["RingSpec", "ShmChannelSpec", "ShmChannel", "shm_pair", "default_bell_dir"]


class ShmChannel(RingChannel):
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
        self._peer_alive_fn = peer_alive
        self._peer_pid = 0
        create = side == "a"
        tx_spec, rx_spec = (spec.a_to_b, spec.b_to_a) if create else (spec.b_to_a, spec.a_to_b)
        tx = _Ring(tx_spec, create)
        try:
            rx = _Ring(rx_spec, create)
        except BaseException:
            tx.release(unlink=create)
            raise
        self._finalizer = weakref.finalize(self, _release_rings, [tx, rx], create)
        tx.ctl[W_PID] = os.getpid()
        rx.ctl[R_PID] = os.getpid()
        module = shm_fast.load() if fast is None or fast else None
        if fast and module is None:
            self._finalizer()
            raise RuntimeError(f"the shm fast path is unavailable "
                               f"({shm_fast.EXTENSION.build_error() or 'LAMINA_KERNELS=torch'})")
        super().__init__(tx, rx, limits=limits, spin_us=spin_us, wake_interval=wake_interval,
                         fast=module)
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
        return self.side == "b" or bool(self._tx.ctl[R_PID])

    # ------------------------------------------------------------------ liveness / state

    def set_peer_alive(self, fn: Callable[[], bool] | None) -> None:
        """Install (or with ``None`` remove) the peer-liveness hook."""
        self._peer_alive_fn = fn

    def peer_alive(self) -> bool:
        """Whether the peer is alive: the hook if set, else its recorded pid (unknown = alive)."""
        if self._peer_alive_fn is not None:
            return bool(self._peer_alive_fn())
        if not self._peer_pid and not self._closed:
            self._peer_pid = int(self._tx.ctl[R_PID])
        pid = self._peer_pid
        return pid in (0, os.getpid()) or _pid_alive(pid)

    # ------------------------------------------------------------------ RingChannel hooks

    def _on_check(self) -> None:
        if self._named and self._peer_attached():
            self._drop_names()

    def _release(self) -> None:
        self._finalizer()

    def _release_busy(self) -> None:
        """A thread is still inside: keep the mapping; the creator drops the names."""
        if self.side == "a":
            with self._close_lock:
                self._named = False
                for ring in (self._tx, self._rx):
                    if os.getpid() == ring.owner_pid:
                        ring.unlink()


def shm_pair(capacity: int = 8 << 20, **kwargs: Any) -> tuple[ShmChannel, ShmChannel]:
    """Both ends of a shared-memory link in this process (for tests and threads)."""
    a = ShmChannel.create(capacity, **kwargs)
    try:
        return a, ShmChannel.attach(a.spec, **kwargs)
    except BaseException:
        a.close()
        raise
