"""RDMA links (``transport="rdma"``): the ring protocol of :mod:`lamina.transport.ring` over
RDMA WRITEs on a reliable-connected (RC) queue pair, through ``pyverbs`` (rdma-core).

Each end registers one memory region per direction holding a full copy of that ring (control
block + data); the peer learns its address and rkey. The protocol's primitive maps to verbs:

* ``store(word, value)``: the 8-byte control word is written locally, then RDMA-written to
  the same offset of the peer's copy;
* ``publish(start, end)``: the data bytes (one or two ranges, around the wrap) are
  RDMA-written from the local copy to the peer's;

on one QP, whose writes an RC connection delivers in order: data before the ``head`` that
announces it, and ``tail`` (the writer's credits) back the other way. Every write is signaled
and its completion polled before the call returns (simple; batching completions is the next
step), and a failed completion marks the peer dead (:class:`~lamina.transport.base.PeerDied`).
Receivers poll their local copy (spin, then a 50 us sleep between polls: nothing on the far
host can ring a doorbell here).

Setup goes over the control plane and is authenticated like tcp: :func:`listen` opens a
:class:`~lamina.transport.tcp.TcpListener` (HMAC handshake, :mod:`lamina.transport.auth`);
the joiner connects with the endpoint's secret; both send their QP number, port LID, GID and
each region's address and rkey in one OPEN message, move their QPs to RTS and close the tcp
link. :func:`rdma_pair` makes both ends in one process on one HCA (two QPs), for tests.

Verified: nothing here has run on a device (none is lent to this project); the protocol above
it runs in CI over shared memory. Where no device exists, :func:`unavailable` says what is
missing and every entry point raises :class:`RdmaUnavailable` with that text, never falling
back to another transport.
"""
from __future__ import annotations

import ctypes
import os
import secrets
from typing import Any, Callable

from lamina import env
from lamina.transport.base import PeerDied
from lamina.transport.ring import RingChannel
from lamina.transport.ring_memory import CTL_BYTES, R_PID, W_PID, PollBell, RingMemory
from lamina.transport.wire import DEFAULT_LIMITS, Message, MsgKind, WireLimits

PORT = 1
GID_INDEX = int(env.text("LAMINA_RDMA_GID_INDEX", "0"))


class RdmaUnavailable(RuntimeError):
    """RDMA was asked for where it cannot run (no pyverbs, no device); the message says which."""


def unavailable() -> str | None:
    """Why RDMA cannot run here (``None``: pyverbs imports and sees at least one device)."""
    try:
        from pyverbs.device import get_device_list
    except ImportError as e:
        return (f"transport 'rdma' needs pyverbs (rdma-core's Python bindings: apt install "
                f"python3-pyverbs, or build rdma-core) and an RDMA device; pyverbs: {e}")
    try:
        devices = get_device_list()
    except Exception as e:  # noqa: BLE001 - a verbs error is just as fatal
        return f"transport 'rdma': listing RDMA devices failed: {e}"
    if not devices:
        return "transport 'rdma' needs an RDMA device (InfiniBand / RoCE HCA); ibv_get_device_list found none"
    return None


def require() -> None:
    """Raise :class:`RdmaUnavailable` unless RDMA can run here."""
    why = unavailable()
    if why is not None:
        raise RdmaUnavailable(why)


class _Verbs:
    """One end's verbs resources: device context, protection domain, completion queue and
    the RC queue pair both of its rings write through."""

    def __init__(self, device: str | None = None, depth: int = 64) -> None:
        require()
        import pyverbs.enums as e
        from pyverbs.cq import CQ
        from pyverbs.device import Context, get_device_list
        from pyverbs.pd import PD
        from pyverbs.qp import QP, QPCap, QPInitAttr

        name = device or get_device_list()[0].name.decode()
        self.e = e
        self.ctx = Context(name=name)
        self.pd = PD(self.ctx)
        self.cq = CQ(self.ctx, depth)
        cap = QPCap(max_send_wr=depth, max_recv_wr=1, max_send_sge=1, max_recv_sge=1)
        self.qp = QP(self.pd, QPInitAttr(qp_type=e.IBV_QPT_RC, scq=self.cq, rcq=self.cq, cap=cap))
        port = self.ctx.query_port(PORT)
        self.lid = port.lid
        self.gid = self.ctx.query_gid(PORT, GID_INDEX).gid
        self.psn = secrets.randbelow(1 << 24)
        self.dead = False

    def info(self) -> dict[str, Any]:
        return {"qpn": self.qp.qp_num, "lid": self.lid, "gid": self.gid, "psn": self.psn}

    def connect(self, peer: dict[str, Any]) -> None:
        """Move the QP to RTS towards ``peer`` (its :meth:`info`); pyverbs' ``to_rts`` walks
        RESET -> INIT -> RTR -> RTS with the one set of attributes, as rdma-core's tests do."""
        from pyverbs.addr import GID, AHAttr, GlobalRoute
        from pyverbs.qp import QPAttr

        e = self.e
        gid = GID()
        gid.gid = peer["gid"]
        attr = QPAttr(port_num=PORT)
        attr.qp_access_flags = e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE
        attr.path_mtu = e.IBV_MTU_1024
        attr.dest_qp_num = int(peer["qpn"])
        attr.rq_psn = int(peer["psn"])
        attr.sq_psn = self.psn
        attr.max_dest_rd_atomic = attr.max_rd_atomic = 1
        attr.min_rnr_timer = 12
        attr.timeout, attr.retry_cnt, attr.rnr_retry = 14, 7, 7
        attr.ah_attr = AHAttr(port_num=PORT, dlid=int(peer["lid"]), is_global=1,
                              gr=GlobalRoute(dgid=gid, sgid_index=GID_INDEX))
        self.qp.to_rts(attr)

    def write(self, lkey: int, local_addr: int, length: int, rkey: int, remote_addr: int) -> None:
        """One signaled RDMA WRITE, waited for; a failed completion marks the link dead."""
        from pyverbs.wr import SGE, SendWR

        if self.dead:
            raise PeerDied("RDMA peer is gone (an earlier write failed)")
        e = self.e
        wr = SendWR(opcode=e.IBV_WR_RDMA_WRITE, num_sge=1, sg=[SGE(local_addr, length, lkey)],
                    send_flags=e.IBV_SEND_SIGNALED)
        wr.set_wr_rdma(rkey, remote_addr)
        self.qp.post_send(wr)
        while True:
            n, wcs = self.cq.poll()
            if n:
                if wcs[0].status != e.IBV_WC_SUCCESS:
                    self.dead = True
                    raise PeerDied(f"RDMA write failed (work completion status {wcs[0].status})")
                return

    def close(self) -> None:
        for r in ("qp", "cq", "pd", "ctx"):
            obj = getattr(self, r, None)
            if obj is not None:
                obj.close()


class VerbsRing(RingMemory):
    """One direction's ring at one end: a registered local copy; ``store``/``publish`` write
    through to the peer's copy (``remote_addr``, ``rkey``, set by :meth:`attach_peer`)."""

    mirrored = True

    def __init__(self, verbs: _Verbs, capacity: int) -> None:
        from pyverbs.mr import MR

        e = verbs.e
        self.verbs = verbs
        self.capacity = capacity
        self.mr = MR(verbs.pd, CTL_BYTES + capacity,
                     e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE)
        self.ctl_addr = int(self.mr.buf)
        self.data_addr = self.ctl_addr + CTL_BYTES
        raw = (ctypes.c_char * (CTL_BYTES + capacity)).from_address(self.ctl_addr)
        buf = memoryview(raw).cast("B")
        buf[:CTL_BYTES] = bytes(CTL_BYTES)
        self.ctl = buf[:CTL_BYTES].cast("Q")
        self.data = buf[CTL_BYTES:]
        self.data_bell = PollBell()
        self.space_bell = PollBell()
        self.remote_addr = 0
        self.rkey = 0

    def info(self) -> dict[str, int]:
        return {"addr": self.ctl_addr, "rkey": self.mr.rkey}

    def attach_peer(self, info: dict[str, int]) -> None:
        self.remote_addr, self.rkey = int(info["addr"]), int(info["rkey"])

    def store(self, word: int, value: int) -> None:
        self.ctl[word] = value
        self.verbs.write(self.mr.lkey, self.ctl_addr + 8 * word, 8, self.rkey, self.remote_addr + 8 * word)

    def publish(self, start: int, end: int) -> None:
        cap = self.capacity
        while start < end:
            pos = start % cap
            n = min(end - start, cap - pos)
            self.verbs.write(self.mr.lkey, self.data_addr + pos, n, self.rkey,
                             self.remote_addr + CTL_BYTES + pos)
            start += n

    def release(self, unlink: bool) -> None:
        for v in ("ctl", "data"):
            try:
                getattr(self, v).release()
            except (AttributeError, BufferError):
                pass
        self.mr.close()


class RdmaChannel(RingChannel):
    """One end of an RDMA duplex link (see the module docstring). Build with :func:`listen` /
    :func:`connect` (across processes or hosts) or :func:`rdma_pair` (one process).
    ``peer_alive``: optional liveness hook (e.g. the peer process's ``is_alive``); a failed
    write counts as death in any case."""

    def __init__(self, capacity: int, *, device: str | None = None,
                 peer_alive: Callable[[], bool] | None = None, limits: WireLimits = DEFAULT_LIMITS,
                 spin_us: float = 100.0, wake_interval: float = 0.05) -> None:
        self._verbs = _Verbs(device)
        tx, rx = VerbsRing(self._verbs, capacity), VerbsRing(self._verbs, capacity)
        super().__init__(tx, rx, limits=limits, spin_us=spin_us, wake_interval=wake_interval,
                         fast=_fast())
        self._peer_alive_fn = peer_alive

    def info(self) -> dict[str, Any]:
        """What the peer needs: QP address and both regions (its rx is our tx)."""
        return {**self._verbs.info(), "tx": self._tx.info(), "rx": self._rx.info(),
                "capacity": self._tx.capacity}

    def join(self, peer: dict[str, Any]) -> None:
        """Connect to ``peer`` (its :meth:`info`): our tx writes its rx, our rx its tx."""
        if int(peer["capacity"]) != self._tx.capacity:
            raise ValueError(f"RDMA ring capacities differ: {peer['capacity']} vs {self._tx.capacity}")
        self._tx.attach_peer(peer["rx"])
        self._rx.attach_peer(peer["tx"])
        self._verbs.connect(peer)
        self._tx.store(W_PID, os.getpid())
        self._rx.store(R_PID, os.getpid())

    def set_peer_alive(self, fn: Callable[[], bool] | None) -> None:
        """Install (or with ``None`` remove) the peer-liveness hook."""
        self._peer_alive_fn = fn

    def peer_alive(self) -> bool:
        if self._verbs.dead:
            return False
        return True if self._peer_alive_fn is None else bool(self._peer_alive_fn())

    def _release(self) -> None:
        for ring in (self._tx, self._rx):
            ring.release(False)
        self._verbs.close()


def _fast() -> Any:
    from lamina.transport import shm_fast

    return shm_fast.load()


def rdma_pair(capacity: int = 8 << 20, **kwargs: Any) -> tuple[RdmaChannel, RdmaChannel]:
    """Both ends of an RDMA link in this process: two QPs on one HCA, connected to each other."""
    a = RdmaChannel(capacity, **kwargs)
    b = RdmaChannel(capacity, **kwargs)
    a_info, b_info = a.info(), b.info()
    a.join(b_info)
    b.join(a_info)
    return a, b


class RdmaListener:
    """The opener's side of an RDMA endpoint: an authenticated tcp listener for the setup
    exchange; :meth:`accept` returns the connected :class:`RdmaChannel`."""

    def __init__(self, host: str, capacity: int, spin_us: float) -> None:
        from lamina.transport.tcp import TcpListener

        require()
        self._tcp = TcpListener(host, 0)
        self.address = self._tcp.address
        self.secret = self._tcp.secret
        self.capacity, self.spin_us = capacity, spin_us

    def accept(self, timeout: float | None = None) -> RdmaChannel:
        ctl = self._tcp.accept(timeout=timeout)
        try:
            ch = RdmaChannel(self.capacity, spin_us=self.spin_us)
            peer = ctl.recv(timeout)
            ctl.send(Message(MsgKind.OK, meta={"rdma": ch.info()}))
            ch.join(peer.meta["rdma"])
            return ch
        finally:
            ctl.close()

    def close(self) -> None:
        self._tcp.close()


def connect(host: str, port: int, secret: str, capacity: int, *, spin_us: float = 100.0,
            timeout: float = 30.0) -> RdmaChannel:
    """Join the RDMA endpoint at ``host:port`` (its tcp setup listener, proven with ``secret``)."""
    from lamina.transport.tcp import TcpChannel

    require()
    ch = RdmaChannel(capacity, spin_us=spin_us)
    ctl = TcpChannel.connect(host, port, timeout, secret=secret)
    try:
        ctl.send(Message(MsgKind.OPEN, meta={"rdma": ch.info()}))
        ch.join(ctl.recv(timeout).meta["rdma"])
    finally:
        ctl.close()
    return ch
