"""One conformance suite for every Channel backend.

Backends: ``local`` (in-process queue), ``shm_thread`` / ``shm_process`` (shared-memory rings),
``tcp_thread`` / ``tcp_process`` (a TCP connection over loopback), each with the peer in a
thread of this process or in a real ``spawn`` child, and ``rdma_thread`` (the same ring
protocol over RDMA WRITEs: two QPs on one HCA), skipped with the reason where pyverbs or an
RDMA device is missing. The peer echoes every message
(tests/transport/shm_peers.py). Expected values come from the test itself (the tensors it sent,
bytes it built with ``struct`` from the documented layout), never from the code under test.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import threading
import time
import uuid

import pytest
import torch

from lamina.transport import (ChannelClosed, Message, MsgKind, PeerDied, ShmChannel, WireError,
                              codec, local_pair, shm_pair)
from lamina.transport import rdma
from lamina.transport.tcp import TcpChannel, TcpListener
from lamina.transport.wire import encode_bytes
from lamina.types import AttendMsg, AttendResult, KVChunk, NodeStats, PrepareMsg, ShardWork
from shm_peers import cpu_seconds, serve_one, serve_specs, serve_tcp
from wire_cases import MALFORMED, MALFORMED_MATCH, assert_same

# shm_thread: both ends on the C++ fast path when it builds; shm_py_thread: both on the Python
# path; shm_mixed_thread: one end each (the bytes on the wire are the same).
SHM_THREAD = {"shm_thread": (None, None), "shm_py_thread": (False, False),
              "shm_mixed_thread": (None, False)}
BACKENDS = ["local", *SHM_THREAD, "shm_process", "tcp_thread", "tcp_process", "rdma_thread"]
STREAM_BACKENDS = [*SHM_THREAD, "shm_process", "tcp_thread", "tcp_process", "rdma_thread"]  # byte streams
N_FRESH = 24  # dedicated (breakable) channels served by each spawned peer
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.uint8,
          torch.bool, torch.float64, torch.int16, torch.int8]


# ------------------------------------------------------------------------------ fixtures


def tcp_pair(**kw) -> tuple[TcpChannel, TcpChannel]:
    """Both ends of a loopback TCP link in this process (the handshake needs both ends at
    once: the listener accepts in a thread)."""
    with TcpListener("127.0.0.1", 0) as lis:
        got: list = []
        t = threading.Thread(target=lambda: got.append(lis.accept(timeout=10, **kw)))
        t.start()
        b = TcpChannel.connect(*lis.address, secret=lis.secret, **kw)
        t.join(15)
        if not got:
            b.close()
            raise RuntimeError("the listener accepted nothing")
        return got[0], b


class ProcessPeer:
    """A spawned child echoing on one main channel and N_FRESH more. ``kind`` "shm": 8 MiB main
    ring and 64 KiB ones; "tcp": 1 + N_FRESH connections to a listener of ours."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        ctx = mp.get_context("spawn")
        if kind == "shm":
            self.chans = [ShmChannel.create(8 << 20)] + \
                [ShmChannel.create(64 << 10) for _ in range(N_FRESH)]
            self.proc = ctx.Process(target=serve_specs, args=([c.spec for c in self.chans],),
                                    daemon=True)
            self.proc.start()
        else:
            with TcpListener("127.0.0.1", 0) as lis:
                self.proc = ctx.Process(target=serve_tcp,
                                        args=(*lis.address, lis.secret, 1 + N_FRESH),
                                        daemon=True)
                self.proc.start()
                self.chans = []
                try:
                    for _ in range(1 + N_FRESH):
                        self.chans.append(lis.accept(timeout=120))
                except BaseException:
                    self.shutdown()
                    raise
        for c in self.chans:
            c.set_peer_alive(self.proc.is_alive)
        for c in self.chans:  # the child serves every channel (attached before we may close)
            sync(c)
        self.main = self.chans[0]
        self.fresh_chans = self.chans[1:]
        self._next = 0

    def fresh(self):
        if self._next == len(self.fresh_chans):
            raise RuntimeError(f"all {N_FRESH} dedicated channels are used: raise N_FRESH")
        ch = self.fresh_chans[self._next]
        self._next += 1
        return ch

    def shutdown(self) -> None:
        for c in self.chans:
            c.close()
        self.proc.join(60)
        if self.proc.is_alive():
            self.proc.kill()


@pytest.fixture(scope="module")
def shm_process_peer():
    peer = ProcessPeer("shm")
    yield peer
    paths = [p for c in peer.chans for p in c.spec.paths()]
    peer.shutdown()
    assert peer.proc.exitcode == 0
    assert [p for p in paths if os.path.exists(p)] == []  # segments and doorbell FIFOs


@pytest.fixture(scope="module")
def tcp_process_peer():
    peer = ProcessPeer("tcp")
    yield peer
    peer.shutdown()
    assert peer.proc.exitcode == 0


def sync(ch) -> None:
    """Round-trip a unique PING so nothing from this test is left in flight."""
    token = uuid.uuid4().hex
    ch.send(Message(MsgKind.PING, meta={"sync": token}))
    while ch.recv(timeout=60).meta.get("sync") != token:
        pass


def _thread_link(backend: str):
    if backend == "local":
        a, b = local_pair()
    elif backend in SHM_THREAD:
        fast_a, fast_b = SHM_THREAD[backend]
        a = ShmChannel.create(8 << 20, fast=fast_a)
        b = ShmChannel.attach(a.spec, fast=fast_b)
    elif backend == "rdma_thread":
        why = rdma.unavailable()
        if why is not None:
            pytest.skip(why)
        a, b = rdma.rdma_pair(8 << 20)
    else:
        a, b = tcp_pair()
    t = threading.Thread(target=serve_one, args=(b,), daemon=True)
    t.start()
    return a, b, t


def _process_peer(backend: str, request) -> ProcessPeer:
    return request.getfixturevalue(backend.replace("_process", "_process_peer"))


@pytest.fixture(params=BACKENDS)
def backend(request) -> str:
    return request.param


@pytest.fixture
def link(backend, request):
    """Our end of a channel whose peer echoes; shared with other tests for *_process."""
    if backend.endswith("_process"):
        ch = _process_peer(backend, request).main
        yield ch
        sync(ch)
        return
    a, b, t = _thread_link(backend)
    yield a
    a.close()
    t.join(30)
    b.close()
    assert not t.is_alive()


@pytest.fixture
def fresh_link(backend, request):
    """Like ``link`` but never shared: the test may break or close it."""
    if backend.endswith("_process"):
        yield _process_peer(backend, request).fresh()
        return
    a, b, t = _thread_link(backend)
    yield a
    a.close()
    t.join(30)
    b.close()


# ------------------------------------------------------------------------------ data path


def test_ordering_many_messages(link):
    n = 300
    sent = [Message(MsgKind.ATTEND, step_id=i, layer=i % 7, reply_to=i % 3, meta={"i": i},
                    tensors=[torch.full((i % 5 + 1,), float(i))]) for i in range(n)]
    sender = threading.Thread(target=lambda: [link.send(m) for m in sent])
    sender.start()  # send and receive concurrently so no ring can fill up in both directions
    got = [link.recv(timeout=60) for _ in range(n)]
    sender.join()
    for m, g in zip(sent, got):
        assert (g.kind, g.step_id, g.layer, g.reply_to, g.meta) == \
            (m.kind, m.step_id, m.layer, m.reply_to, m.meta)
        assert_same(m.tensors, g.tensors)


def test_large_tensor_through_small_ring(link):
    big = torch.randn(12 << 20)  # 48 MiB; the shm rings hold 8 MiB
    small = torch.arange(10)
    link.send(Message(MsgKind.KV, tensors=[small, big, small]))
    got = link.recv(timeout=120)
    assert_same([small, big, small], got.tensors)


def test_every_dtype_and_shape(link):
    g = torch.Generator().manual_seed(0)
    tensors = []
    for dt in DTYPES:
        if dt == torch.bool:
            base = torch.rand(3, 5, generator=g) > 0.5
        elif dt.is_floating_point:
            base = torch.randn(3, 5, generator=g).to(dt)
            base[0, 0], base[0, 1], base[0, 2] = float("inf"), float("nan"), -0.0
        else:
            info = torch.iinfo(dt)
            base = torch.randint(max(info.min, -1000), min(info.max, 1000), (3, 5), generator=g,
                                 dtype=torch.int64).to(dt)
            base[0, 0], base[0, 1] = info.min, info.max
        tensors += [base, base[0, 0].clone(), base[:0], base.t(), torch.empty(2, 0, 3, dtype=dt),
                    base.reshape(1, 1, 1, 1, 1, 1, 1, 15)]
    for i in range(0, len(tensors), 30):  # stay under the default 64 tensors per message
        part = tensors[i:i + 30]
        link.send(Message(MsgKind.IMPORT, tensors=part))
        assert_same(part, link.recv(timeout=60).tensors)


def test_header_fields_and_meta_round_trip(link):
    meta = {"unicode": "héllo ✓", "nested": {"a": [1, 2.5, None, True, False]}, "big": 2 ** 62,
            "neg": -3, "empty": {}, "list": [[1, 2], []], "float": 1e-300}
    for kind in MsgKind:
        m = Message(kind, step_id=-(2 ** 63), layer=2 ** 63 - 1, reply_to=-1, meta=meta)
        link.send(m)
        g = link.recv(timeout=60)
        assert (g.kind, g.step_id, g.layer, g.reply_to, g.meta, g.tensors) == \
            (kind, m.step_id, m.layer, m.reply_to, meta, [])
    link.send(Message(MsgKind.PING, meta={"tuple": (1, 2)}))
    assert link.recv(timeout=60).meta == {"tuple": [1, 2]}  # what JSON gives, on every backend


def test_codec_objects_round_trip(link):
    q, k, v = torch.randn(3, 4, 8), torch.randn(2, 2, 8), torch.randn(2, 2, 8)
    objs = [
        PrepareMsg(7, [ShardWork(1, 0, 3, 0, 3), ShardWork(2, 9, 1)]),
        AttendMsg(7, 2, q, k, v, reply_to=5),
        AttendResult(7, 2, torch.randn(3, 4, 8), torch.full((3, 4), float("-inf"))),
        KVChunk(4, 100, torch.randn(2, 5, 2, 8), torch.randn(2, 5, 2, 8)),
        NodeStats(1024, 10, 1014, 256, 4, 1, 3, 2, shards={1: (0, 3), 2: (5, 7)}),
    ]
    for obj in objs:
        link.send(codec.to_message(obj))
        back = codec.from_message(link.recv(timeout=60))
        assert type(back) is type(obj)
        for name, val in vars(obj).items():
            if isinstance(val, torch.Tensor):
                assert_same([val], [getattr(back, name)])
            else:
                assert getattr(back, name) == val
    link.send(codec.to_message(KeyError("req 3")))
    with pytest.raises(KeyError, match="req 3"):
        codec.raise_if_error(link.recv(timeout=60))


# ------------------------------------------------------------------------------ timeouts, limits


def test_recv_timeout(link):
    for timeout in (0, 0.05, 0.3):
        with pytest.raises(TimeoutError):
            link.recv(timeout=timeout)
    link.send(Message(MsgKind.PING, meta={"sleep": 0.2}))  # arrives after the first timeout
    with pytest.raises(TimeoutError):
        link.recv(timeout=0.01)
    assert link.recv(timeout=60).meta == {"sleep": 0.2}


@pytest.mark.parametrize("bad", ["too_many_tensors", "dtype", "ndim", "meta", "meta_size",
                                 "tensor_size", "not_tensor", "kind"])
def test_send_rejects_what_cannot_travel(link, bad):
    small = link.limits.__class__(max_tensor_bytes=1 << 20, max_meta_bytes=1 << 10)
    m = {"too_many_tensors": Message(MsgKind.KV, tensors=[torch.zeros(1)] * 65),
         "dtype": Message(MsgKind.KV, tensors=[torch.zeros(2, dtype=torch.complex64)]),
         "ndim": Message(MsgKind.KV, tensors=[torch.zeros([1] * 9)]),
         "meta": Message(MsgKind.PING, meta={"x": {1, 2}}),
         "meta_size": Message(MsgKind.PING, meta={"x": "y" * (5 << 20)}),
         "tensor_size": Message(MsgKind.KV, tensors=[torch.zeros(small.max_tensor_bytes)]),
         "not_tensor": Message(MsgKind.KV, tensors=[[1.0, 2.0]]),
         "kind": Message(99)}[bad]
    limits = link.limits
    if bad == "tensor_size":  # checked against this end's limits
        link.limits = small
    try:
        with pytest.raises(WireError):
            link.send(m)
    finally:
        link.limits = limits
    link.send(Message(MsgKind.PING, meta={"after": bad}))  # nothing half-sent: still in sync
    assert link.recv(timeout=60).meta == {"after": bad}


@pytest.mark.parametrize("case", sorted(MALFORMED))
@pytest.mark.parametrize("backend", STREAM_BACKENDS)
def test_malformed_stream_raises_wire_error(fresh_link, case):
    fresh_link.send(Message(MsgKind.PING, meta={"inject": MALFORMED[case].hex()}))
    with pytest.raises(WireError, match=MALFORMED_MATCH[case]):
        fresh_link.recv(timeout=30)  # rejected on the header/descriptors: no allocation, no wait
    with pytest.raises(WireError):  # the stream cannot be resynchronised
        fresh_link.recv(timeout=30)


@pytest.mark.parametrize("backend", STREAM_BACKENDS)
def test_partial_message_survives_a_timeout(link):
    """The peer writes a message in two pieces; a recv that times out in between keeps the
    first piece, and the next recv completes the message."""
    m = Message(MsgKind.ATTEND, step_id=4, meta={"x": 1}, tensors=[torch.arange(1000)])
    data = encode_bytes(m)
    for cut in (10, 48, 200, len(data) - 1):  # inside the header, after it, inside the data
        link.send(Message(MsgKind.PING, meta={"inject": data[:cut].hex()}))
        with pytest.raises(TimeoutError):
            link.recv(timeout=0.2)  # the first piece has arrived by now (or soon after)
        link.send(Message(MsgKind.PING, meta={"inject": data[cut:].hex()}))
        out = link.recv(timeout=30)
        assert (out.kind, out.step_id, out.meta) == (m.kind, 4, {"x": 1})
        assert_same(m.tensors, out.tensors)


def test_concurrent_senders_keep_messages_whole(link):
    """Four threads send at once (messages larger than a socket buffer's worth or a ring's
    64 KiB so a torn write would show); every message arrives whole and in per-thread order."""
    n, per = 4, 12

    def sender(k):
        for i in range(per):
            link.send(Message(MsgKind.KV, step_id=k, layer=i,
                              tensors=[torch.full((50_000,), k * 1000 + i, dtype=torch.int32)]))

    threads = [threading.Thread(target=sender, args=(k,)) for k in range(n)]
    for t in threads:
        t.start()
    got = [link.recv(timeout=60) for _ in range(n * per)]
    for t in threads:
        t.join()
    for k in range(n):
        mine = [g for g in got if g.step_id == k]
        assert [g.layer for g in mine] == list(range(per))
        for g in mine:
            assert torch.equal(g.tensors[0], torch.full((50_000,), k * 1000 + g.layer,
                                                        dtype=torch.int32))


# ------------------------------------------------------------------------------ close, death


def test_peer_close(fresh_link):
    fresh_link.send(Message(MsgKind.PING, meta={"n": 1}))
    fresh_link.send(Message(MsgKind.PING, meta={"close": True}))
    assert fresh_link.recv(timeout=30).meta == {"n": 1}  # sent before closing: still delivered
    with pytest.raises(ChannelClosed):
        fresh_link.recv(timeout=30)
    with pytest.raises(ChannelClosed):
        fresh_link.send(Message(MsgKind.PING))


def test_close_wakes_blocked_recv(fresh_link):
    errors = []

    def blocked():
        try:
            fresh_link.recv()
        except Exception as exc:  # noqa: BLE001 - recorded for the assertion below
            errors.append(exc)

    t = threading.Thread(target=blocked)
    t.start()
    t.join(0.2)
    fresh_link.close()
    t.join(30)
    assert not t.is_alive() and len(errors) == 1 and isinstance(errors[0], ChannelClosed)
    with pytest.raises(ChannelClosed):
        fresh_link.send(Message(MsgKind.PING))
    fresh_link.close()  # idempotent


@pytest.mark.parametrize("backend", STREAM_BACKENDS)
def test_close_wakes_blocked_send(fresh_link):
    """We never read, so the echo stalls and then so does our second 32 MiB send (more than
    any ring or socket buffer holds); close() from another thread makes it raise."""
    errors = []
    big = Message(MsgKind.KV, tensors=[torch.zeros(8 << 20)])

    def blocked():
        try:
            for _ in range(4):
                fresh_link.send(big)
        except Exception as exc:  # noqa: BLE001 - recorded for the assertion below
            errors.append(exc)

    t = threading.Thread(target=blocked)
    t.start()
    t.join(1.0)
    assert t.is_alive()  # blocked, not failed
    fresh_link.close()
    t.join(30)
    assert not t.is_alive() and len(errors) == 1 and isinstance(errors[0], ChannelClosed)


def test_local_hands_over_tensors_without_copy():
    a, b = local_pair()
    t = torch.randn(4)
    a.send(Message(MsgKind.ATTEND, tensors=[t]))
    assert b.recv(timeout=1).tensors[0] is t
    a.close()
    b.close()


@pytest.mark.parametrize("backend", STREAM_BACKENDS)
def test_peer_alive_hook_reports_death(fresh_link):
    """When the liveness hook says the peer is gone, a blocked recv raises PeerDied (within
    about the backend's wake interval) although the link itself is still open."""
    fresh_link.set_peer_alive(lambda: False)
    t0 = time.monotonic()
    with pytest.raises(PeerDied):
        fresh_link.recv(timeout=30)
    assert time.monotonic() - t0 < 5


def _shm_death_setup():
    by_pid = ShmChannel.create(1 << 16, wake_interval=0.02)
    by_hook = ShmChannel.create(4096, wake_interval=0.02)
    proc = mp.get_context("spawn").Process(target=serve_specs,
                                           args=([by_pid.spec, by_hook.spec],), daemon=True)
    proc.start()
    return proc, by_pid, by_hook


def _tcp_death_setup():
    with TcpListener("127.0.0.1", 0) as lis:
        proc = mp.get_context("spawn").Process(target=serve_tcp,
                                               args=(*lis.address, lis.secret, 2),
                                               daemon=True)
        proc.start()
        chans = []
        try:
            chans = [lis.accept(timeout=120, wake_interval=0.02) for _ in range(2)]
        except BaseException:
            proc.kill()
            raise
    chans[0].set_peer_alive(proc.is_alive)  # TCP cannot tell death from close without a hook
    return proc, chans[0], chans[1]


@pytest.mark.parametrize("kind", ["shm", "tcp"])
def test_peer_death_detected_across_processes(kind):
    """A child that dies while we wait: recv raises PeerDied (shm: pid-based default check, the
    dead child is an unreaped zombie; tcp: the ``peer_alive`` hook), and so does a send of more
    than the link holds (``peer_alive`` hook)."""
    proc, by_recv, by_send = _shm_death_setup() if kind == "shm" else _tcp_death_setup()
    try:
        by_send.set_peer_alive(proc.is_alive)
        for ch in (by_recv, by_send):
            ch.send(Message(MsgKind.PING, meta={"ready": 1}))
            assert ch.recv(timeout=120).meta == {"ready": 1}
        assert by_recv.peer_alive() and by_send.peer_alive()
        by_recv.send(Message(MsgKind.PING, meta={"exit": 3}))
        with pytest.raises(PeerDied):
            by_recv.recv()  # blocks until the child is gone
        with pytest.raises(PeerDied):  # more than the ring / the socket buffers hold
            by_send.send(Message(MsgKind.KV, tensors=[torch.zeros(1 << 16 if kind == "shm"
                                                                  else 16 << 20)]))
        if kind == "shm":
            assert not by_recv.peer_alive()
        proc.join(30)
        assert proc.exitcode == 3
    finally:
        by_recv.close()
        by_send.close()
        if proc.is_alive():
            proc.kill()


@pytest.mark.parametrize("kind", ["shm", "tcp"])
def test_idle_receivers_use_almost_no_cpu(kind, request):
    """The spawned peer has 1 + N_FRESH threads blocked in recv; so has, below, one thread of
    ours. CPU time (not wall time) over ~1 s must stay far below one core."""
    peer = request.getfixturevalue(f"{kind}_process_peer")
    sync(peer.main)
    a, b = shm_pair(1 << 16) if kind == "shm" else tcp_pair(peer_alive=lambda: True)
    used = []

    def idle():
        t0 = time.thread_time()
        with pytest.raises(TimeoutError):
            b.recv(timeout=1.0)
        used.append(time.thread_time() - t0)

    child0 = cpu_seconds(peer.proc.pid)
    t = threading.Thread(target=idle)
    t.start()
    t.join()
    child = cpu_seconds(peer.proc.pid) - child0
    a.close()
    b.close()
    print(f"\n{kind}: idle recv thread: {used[0]:.4f} CPU-s over 1 s; spawned peer with "
          f"{1 + N_FRESH} blocked receivers: {child:.3f} CPU-s")
    assert used[0] < 0.1
    assert child < 0.3
