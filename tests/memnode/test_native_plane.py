"""The memory node's native ATTEND path against the Python path (the reference): for random
steps, shards, mini-batches, dtypes and malformed ATTENDs, the native plane's replies are the
Python path's (kind, ids, tensors byte for byte, meta; the span's times aside), node state stays
equal, and whatever the plane does not take stays in the ring for Python, untouched."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lamina import stages
from lamina.memnode.native import HANDOFF, IDLE, plane_for, unavailable
from lamina.memnode.node import MemoryNode
from lamina.memnode.server import handle
from lamina.transport import codec
from lamina.transport.shm import shm_pair
from lamina.transport.wire import Message, MsgKind, WireError
from lamina.types import AttendMsg, AttentionSpec, KVChunk, PrepareMsg, ShardWork

HEADS, KV_HEADS, DIM = 4, 2, 16
SPECS = [AttentionSpec(layer=10 + i, num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=DIM,
                       scale=DIM ** -0.5, window=w) for i, w in enumerate((None, 3, None))]
PEER = 7


def _node(pool: torch.dtype | str) -> MemoryNode:
    """A node whose pool holds ``pool``: a float dtype, or a KV format's name."""
    if isinstance(pool, str):
        return MemoryNode(SPECS, 256, slab_size=8, kv_dtype=pool)
    return MemoryNode(SPECS, 256, slab_size=8, dtype=pool)


@pytest.fixture
def native_available():
    why = unavailable(_node(torch.float32))
    if why is not None:
        pytest.skip(f"no native plane here: {why}")


class Twin:
    """Two equal nodes: ``py`` answers with :func:`handle`, ``nat`` through its plane over a
    shm link (``client`` sends, the node's end is ``node_end``; replies come back on it)."""

    def __init__(self, dtype: torch.dtype | str) -> None:
        self.py, self.nat = _node(dtype), _node(dtype)
        self.nat.plane = plane_for(self.nat)
        assert self.nat.plane is not None
        # the plane serves until it idles one wake interval: keep that short here
        self.client, self.node_end = shm_pair(capacity=1 << 20, spin_us=0.0, wake_interval=0.002)
        self.nat.plane.add_peer(PEER, self.node_end.native_tx())

    def close(self) -> None:
        self.nat.plane.remove_peer(PEER)
        self.client.close()
        self.node_end.close()

    def both(self, msg: Message) -> tuple[Message, Message, bool]:
        """(Python's reply, the native side's reply, whether the plane served it)."""
        want = handle(self.py, msg)
        self.client.send(msg)
        status = self.node_end.serve_native(self.nat.plane.serve)  # it takes the lock itself
        served = status == IDLE
        if not served:
            assert status == HANDOFF
            got_msg = self.node_end.recv(5)  # still whole in the ring: Python takes it
            assert _same(got_msg, msg)
            with self.nat.plane.lock:
                reply = handle(self.nat, got_msg)
            return want, reply, False
        return want, self.client.recv(5), served


def _same(a: Message, b: Message) -> bool:
    if (a.kind, a.step_id, a.layer, a.reply_to, a.meta) != (b.kind, b.step_id, b.layer,
                                                            b.reply_to, b.meta):
        return False
    return len(a.tensors) == len(b.tensors) and all(
        x.dtype == y.dtype and x.shape == y.shape and
        x.contiguous().view(torch.uint8).equal(y.contiguous().view(torch.uint8))
        for x, y in zip(a.tensors, b.tensors))


def _no_span(msg: Message) -> Message:
    """A RESULT without its span (the node's times: the last tensor, int64 [2])."""
    if msg.kind != MsgKind.RESULT:
        return msg
    assert len(msg.tensors) == 3
    span = msg.tensors[-1]
    assert span.dtype == torch.int64 and span.shape == (2,) and span[0] <= span[1]
    return Message(msg.kind, msg.step_id, msg.layer, msg.reply_to, msg.meta, msg.tensors[:-1])


def _state(node: MemoryNode) -> tuple:
    node.sync()
    s = node.stats()
    return (s.used_slots, s.num_requests, sorted(s.shards.items()), sorted(node.in_flight),
            node.pool.k_cache.view(torch.uint8).clone(), node.pool.v_cache.view(torch.uint8).clone(),
            [None if x is None else x.clone() for x in (node.pool.k_scale, node.pool.v_scale)])


def _equal_state(a: MemoryNode, b: MemoryNode) -> None:
    sa, sb = _state(a), _state(b)
    assert sa[:4] == sb[:4]
    assert torch.equal(sa[4], sb[4]) and torch.equal(sa[5], sb[5])
    assert all(x is y is None or torch.equal(x, y) for x, y in zip(sa[6], sb[6]))


def _random_steps(first, parts: int, qdt: torch.dtype, seed: int, reply_to: int = 0):
    """Two steps of the requests ``first`` (``(req, start, n)``: a prefill of n positions, then
    one more token each), layers in a random order, each split into up to ``parts`` random
    mini-batches: yields each step's PrepareMsg, then its AttendMsgs, then None."""
    g = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    for step_id, works in enumerate((
            [ShardWork(r, start, n, start, n) for r, start, n in first],
            [ShardWork(r, start + n, 1, start + n, 1) for r, start, n in first])):
        yield PrepareMsg(step_id, works)
        R = len(works)
        for li in rng.permutation(len(SPECS)):
            cuts = sorted(set(rng.integers(1, R, size=parts - 1).tolist())) if R > 1 else []
            for lo, hi in zip([0] + cuts, cuts + [R]):
                nq = sum(w.num_q for w in works[lo:hi])
                na = sum(w.num_append for w in works[lo:hi])
                yield AttendMsg(step_id, SPECS[li].layer,
                                torch.randn(nq, HEADS, DIM, generator=g).to(qdt),
                                torch.randn(na, KV_HEADS, DIM, generator=g),
                                torch.randn(na, KV_HEADS, DIM, generator=g), reply_to=reply_to,
                                works=None if (lo, hi) == (0, R) else (lo, hi))
        yield None


steps = st.lists(st.tuples(st.integers(0, 5), st.integers(0, 4), st.integers(1, 6)),
                 min_size=1, max_size=4, unique_by=lambda t: t[0])


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(first=steps, pool=st.sampled_from([torch.float32, torch.bfloat16, "int8", "fp8_e4m3",
                                         "k16v8"]),
       qdt=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
       parts=st.integers(1, 3), seed=st.integers(0, 2 ** 16))
def test_native_replies_are_the_python_paths(native_available, first, pool, qdt, parts, seed):
    """Two steps (a prefill, then one more token each) of random requests, layers in a random
    order, each split into random mini-batches: every reply and the node state match."""
    twin = Twin(pool)
    try:
        served = 0
        for msg in _random_steps(first, parts, qdt, seed, reply_to=PEER):
            if msg is None:
                _equal_state(twin.py, twin.nat)
            elif isinstance(msg, PrepareMsg):
                a, b, _ = twin.both(codec.to_message(msg))
                assert _same(a, b)
            else:
                want, got, by_plane = twin.both(codec.to_message(msg))
                assert want.kind == MsgKind.RESULT, codec.from_message(want)
                assert _same(_no_span(want), _no_span(got))
                served += by_plane
        assert served > 0
        assert twin.nat.plane.served == served
    finally:
        twin.close()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(first=steps, pool=st.sampled_from([torch.float32, torch.bfloat16, "int8", "k16v8"]),
       qdt=st.sampled_from([torch.float32, torch.bfloat16]), parts=st.integers(1, 3),
       seed=st.integers(0, 2 ** 16))
def test_attend_from_tensors_is_the_python_paths(native_available, first, pool, qdt, parts, seed):
    """MemoryNode.attend with a plane (a node in the engine's process) takes the plane's
    tensor entry: the same results byte for byte and the same node state as without one, and
    every step ends (the plane finished it, Python synced)."""
    py, nat = _node(pool), _node(pool)
    nat.plane = plane_for(nat)
    served = sent = 0
    for msg in _random_steps(first, parts, qdt, seed):
        if msg is None:
            assert nat.in_flight == py.in_flight == []
            _equal_state(py, nat)
        elif isinstance(msg, PrepareMsg):
            for node in (py, nat):
                node.prepare(msg)
        else:
            before = nat.plane.served
            want, got = py.attend(msg), nat.attend(msg)
            served, sent = served + nat.plane.served - before, sent + 1
            for x, y in ((want.o, got.o), (want.lse, got.lse)):
                assert x.dtype == y.dtype and x.view(torch.uint8).equal(y.view(torch.uint8))
    assert served == sent > 0  # every ATTEND took the plane's entry


def test_what_the_plane_does_not_take_stays_for_python(native_available):
    """Unknown steps and layers, a layer attended twice, works that do not continue the layer,
    wrong shapes, an unknown reply peer, other kinds, a corrupt header: the plane leaves each in
    the ring (HANDOFF) and Python answers exactly what the Python path answers."""
    twin = Twin(torch.float32)
    try:
        works = [ShardWork(1, 0, 3, 0, 3), ShardWork(2, 0, 2, 0, 2)]
        assert _same(*twin.both(codec.to_message(PrepareMsg(0, works)))[:2])
        q, kv = torch.randn(5, HEADS, DIM), torch.randn(5, KV_HEADS, DIM)
        bad = [
            AttendMsg(9, 10, q, kv, kv, reply_to=PEER),  # unknown step
            AttendMsg(0, 99, q, kv, kv, reply_to=PEER),  # unknown layer
            AttendMsg(0, 10, q[:4], kv, kv, reply_to=PEER),  # shape
            AttendMsg(0, 10, q[3:], kv[3:], kv[3:], reply_to=PEER, works=(1, 2)),  # not next
        ]
        for m in bad:
            want, got, by_plane = twin.both(codec.to_message(m))
            assert not by_plane and want.kind == MsgKind.ERROR
            assert _same(want, got)
        want, got, by_plane = twin.both(codec.to_message(AttendMsg(0, 10, q, kv, kv, reply_to=PEER)))
        assert by_plane and _same(_no_span(want), _no_span(got))
        again = codec.to_message(AttendMsg(0, 10, q, kv, kv, reply_to=PEER))  # attended twice
        want, got, by_plane = twin.both(again)
        assert not by_plane and want.kind == MsgKind.ERROR and _same(want, got)
        # Python's to compute: a q dtype the C++ kernel does not take; a peer the plane does
        # not write to (the server answers that one with an error of its own)
        for m in (AttendMsg(0, 11, q.double(), kv, kv, reply_to=PEER),
                  AttendMsg(0, 12, q, kv, kv, reply_to=PEER + 1)):
            want, got, by_plane = twin.both(codec.to_message(m))
            assert not by_plane and want.kind == MsgKind.RESULT
            assert _same(_no_span(want), _no_span(got))
        stages.take()  # a PING answers with the stages this process timed so far: none here
        for m in (codec.ping({"x": 1}), codec.free_request([5])):  # (STATS: _equal_state)
            want, got, by_plane = twin.both(m)
            assert not by_plane and _same(want, got)
        _equal_state(twin.py, twin.nat)
        twin.client.send_raw([b"XXXX" + bytes(60)])  # a corrupt stream: Python's to refuse
        assert twin.node_end.serve_native(twin.nat.plane.serve) == HANDOFF
        with pytest.raises(WireError):
            twin.node_end.recv(5)
    finally:
        twin.close()


def test_python_finishes_what_the_plane_finished_and_stats_count_it(native_available):
    """A step whose every layer the plane attended ends at the next sync: its request is free
    for the next PREPARE, and STATS count the plane's attention time."""
    twin = Twin(torch.float32)
    try:
        twin.both(codec.to_message(PrepareMsg(0, [ShardWork(1, 0, 2, 0, 2)])))
        for spec in SPECS:
            _, _, by_plane = twin.both(codec.to_message(AttendMsg(
                0, spec.layer, torch.randn(2, HEADS, DIM), torch.randn(2, KV_HEADS, DIM),
                torch.randn(2, KV_HEADS, DIM), reply_to=PEER)))
            assert by_plane
        assert twin.nat.in_flight == [0]  # the plane finished it; Python has not synced yet
        want, got, _ = twin.both(codec.to_message(PrepareMsg(1, [ShardWork(1, 2, 1, 2, 1)])))
        assert want.kind == got.kind == MsgKind.OK
        assert twin.nat.in_flight == [1]
        assert twin.nat.stats().attend_us == twin.nat.plane.attend_ns // 1000
    finally:
        twin.close()


def test_the_plane_setting_selects_the_python_path(kernels):
    from lamina.config import KernelConfig

    kernels(KernelConfig(plane="python"))
    assert plane_for(_node(torch.float32)) is None
    kernels(KernelConfig(attention="torch", plane="native"))
    with pytest.raises(RuntimeError, match="native plane is unavailable: attention runs"):
        plane_for(_node(torch.float32))


@pytest.mark.parametrize("qdt", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("pool", [torch.float32, "int8"])
def test_a_cascade_is_served_by_the_plane_as_python_serves_it(native_available, monkeypatch,
                                                               pool, qdt):
    """Requests on one shared prefix (prefix caching's SHARE) make a step with a cascade: with
    float32 queries the plane runs it (both kernel calls and the merge) and its results are the
    Python path's byte for byte; other query dtypes it leaves to Python. Mini-batched ATTENDs
    and windowed layers read the plain indices, in the plane as in Python."""
    import lamina.memnode.cascade as cascade_mod
    monkeypatch.setattr(cascade_mod, "MIN_SHARED", 4)  # this test's prefix is short
    monkeypatch.setattr(cascade_mod, "MIN_SAVED", 0)
    g = torch.Generator().manual_seed(1)
    L, P = len(SPECS), 12

    def kv(n: int) -> torch.Tensor:
        return torch.randn(L, n, KV_HEADS, DIM, generator=g)
    prefix, own = (kv(P), kv(P)), {r: (kv(n), kv(n)) for r, n in ((1, 3), (2, 5), (3, 1))}
    py, nat = _node(pool), _node(pool)
    nat.plane = plane_for(nat)
    for node in (py, nat):
        node.import_kv(KVChunk(-1, 0, *prefix))
        for r, (k, v) in own.items():
            node.share(r, [(-1, 0, P)])
            node.import_kv(KVChunk(r, P, k, v))
    ends = {r: P + k.shape[1] for r, (k, _) in own.items()}
    python_only = sent = 0
    for step_id, parts in enumerate(((0, 3), (0, 1, 3), (0, 3))):
        works = [ShardWork(r, ends[r] + step_id, 1, ends[r] + step_id, 1) for r in own]
        for node in (py, nat):
            node.prepare(PrepareMsg(step_id, works))
        assert (py._steps[step_id].cascade is None) == (nat._steps[step_id].cascade is None) \
            is False
        for spec in SPECS:
            for lo, hi in zip(parts[:-1], parts[1:]):
                whole = (lo, hi) == (0, len(works))
                msg = AttendMsg(step_id, spec.layer,
                                torch.randn(hi - lo, HEADS, DIM, generator=g).to(qdt),
                                torch.randn(hi - lo, KV_HEADS, DIM, generator=g),
                                torch.randn(hi - lo, KV_HEADS, DIM, generator=g),
                                works=None if whole else (lo, hi))
                before = nat.plane.served
                want, got = py.attend(msg), nat.attend(msg)
                sent += 1
                python_only += nat.plane.served == before
                assert nat.plane.served - before == int(
                    qdt == torch.float32 or not whole or spec.window is not None)
                for x, y in ((want.o, got.o), (want.lse, got.lse)):
                    assert x.dtype == y.dtype and x.view(torch.uint8).equal(y.view(torch.uint8))
        assert nat.in_flight == py.in_flight == []
        _equal_state(py, nat)
    assert sent > python_only
