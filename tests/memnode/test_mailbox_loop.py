"""A memory node's step-mailbox thread (lamina/memnode/mailbox_loop.py): it answers a SEND
that arrived before its step's PREPARE once the PREPARE is in, with what the node's own
ATTEND gives, and stops cleanly."""
import threading
import time

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lamina.memnode import MemoryNode
from lamina.memnode.mailbox_loop import MailboxLoop
from lamina.transport.mailbox import (REPLY, SEND, Mailbox, MailboxServer, MailboxShape,
                                      SharedMailbox)
from lamina.types import AttendMsg, AttentionSpec, NodeRoute, PrepareMsg, ShardWork

H, HKV, D = 4, 2, 8
SPECS = [AttentionSpec(layer=i, num_heads=H, num_kv_heads=HKV, head_dim=D, scale=D ** -0.5)
         for i in range(2)]


def _route(rows: int) -> NodeRoute:
    r = NodeRoute.__new__(NodeRoute)
    r.node, r.works, r.span = 0, [], None
    r.q_rows = r.kv_rows = torch.arange(rows)
    return r


def _until(cond, timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.001)
    return cond()


@pytest.mark.parametrize("native", [False, True])
def test_a_send_before_its_prepare_is_answered_once_the_prepare_is_in(native):
    shape = MailboxShape(slots=1, nodes=1, tokens=4, heads=H, kv_heads=HKV, dim=D)
    shared = SharedMailbox(shape)
    box = Mailbox(shape, shared.buffer)
    node, twin = (MemoryNode(SPECS, 16, slab_size=4) for _ in range(2))
    lock = threading.Lock()
    if native:
        _native_or_skip(node)
        lock = node.plane.lock
    loop = MailboxLoop(node, lock, {**shared.handle, "node": 0},
                       spin_us=float("inf") if native else 0).start()
    assert (loop.native is not None) == native
    try:
        works = [ShardWork(7, 0, 3, 0, 3)]
        base = box.post(0, 1, 3, [_route(3)], layers=2)
        q, k, v = box.qkv(0)
        for t in (q, k, v):
            t.copy_(torch.randn_like(t))
        box.words(0)[SEND] = base + 1  # layer 0, before the PREPARE
        time.sleep(0.05)
        assert int(box.node_words(0, 0)[REPLY]) == 0  # not ready: not answered
        with lock:
            node.prepare(PrepareMsg(1, works))
        assert _until(lambda: int(box.node_words(0, 0)[REPLY]) == base + 1)
        box.check(0)
        twin.prepare(PrepareMsg(1, works))
        want = twin.attend(AttendMsg(1, 0, q[:3].clone(), k[:3].clone(), v[:3].clone()))
        o, lse = box.landing(0, 0)
        assert torch.equal(o[:3], want.o) and torch.equal(lse[:3], want.lse)
    finally:
        loop.stop()
        shared.close()
    assert not loop._thread.is_alive()


# -- the native poller (memnode/csrc/mailbox_io.h) against the Python server, the reference ----

NSPECS = [AttentionSpec(layer=i, num_heads=H, num_kv_heads=HKV, head_dim=D,
                        scale=D ** -0.5, window=w) for i, w in enumerate((None, 3))]


def _native_or_skip(node):
    from lamina.memnode.native import plane_for, unavailable
    why = unavailable(node)
    if why is not None:
        pytest.skip(f"no native plane here: {why}")
    node.plane = plane_for(node)
    assert node.plane is not None


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       lens=st.lists(st.integers(1, 5), min_size=1, max_size=3),
       decodes=st.integers(1, 3), seed=st.integers(0, 2 ** 16))
def test_native_poll_answers_byte_for_byte_as_the_python_server(dtype, lens, decodes, seed):
    """Random requests (a prefill of ``lens`` tokens each, then ``decodes`` decode steps) over
    both layers: the C++ poller's landing bytes, REPLY and STATUS equal the Python server's."""
    py, nat = (MemoryNode(NSPECS, 64, slab_size=4, dtype=dtype) for _ in range(2))
    _native_or_skip(nat)
    shape = MailboxShape(slots=2, nodes=1, tokens=16, heads=H, kv_heads=HKV, dim=D, dtype=dtype)
    boxes = [Mailbox(shape, SharedMailbox(shape).buffer) for _ in range(2)]
    server = MailboxServer(boxes[0], 0, py.attend)
    seen = torch.zeros(shape.slots, dtype=torch.int64)
    poll = nat.plane.mailbox_poll(boxes[1], 0, seen)
    g = torch.Generator().manual_seed(seed)
    pos = [0] * len(lens)
    for step in range(1 + decodes):
        slot = step % shape.slots
        counts = lens if step == 0 else [1] * len(lens)
        works = [ShardWork(r, pos[r], n, pos[r], n) for r, n in enumerate(counts)]
        pos = [p + n for p, n in zip(pos, counts)]
        rows = sum(counts)
        perm = torch.randperm(rows, generator=g)  # rows in any order within the slot
        route = _route(rows)
        route.q_rows = route.kv_rows = perm
        for node in (py, nat):
            node.prepare(PrepareMsg(step, works))
        bases = [b.post(slot, step, rows, [route], layers=2) for b in boxes]
        for layer in range(2):
            for t in boxes[0].qkv(slot):
                t.copy_(torch.randn(t.shape, generator=g).to(dtype))
            for a, b in zip(boxes[0].qkv(slot), boxes[1].qkv(slot)):
                b.copy_(a)
            for box, base in zip(boxes, bases):
                box.words(slot)[SEND] = base + layer + 1
            assert server.poll()
            assert poll(0, 0) == (1, -1)
            for a, b in zip(boxes[0].landing(slot, 0), boxes[1].landing(slot, 0)):
                assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
            assert torch.equal(boxes[0].node_words(slot, 0), boxes[1].node_words(slot, 0))
        nat.sync()
        for box in boxes:
            box.check(slot)


def test_native_poll_hands_python_what_it_cannot_answer():
    """A SEND for a step not prepared yet comes back as its slot, untouched (the Python
    server then finds it not ready); once prepared, the C++ poller answers it."""
    node = MemoryNode(NSPECS, 64, slab_size=4)
    _native_or_skip(node)
    shape = MailboxShape(slots=2, nodes=1, tokens=4, heads=H, kv_heads=HKV, dim=D)
    box = Mailbox(shape, SharedMailbox(shape).buffer)
    seen = torch.zeros(shape.slots, dtype=torch.int64)
    poll = node.plane.mailbox_poll(box, 0, seen)
    assert poll(0, 0) == (0, -1)  # nothing sent
    base = box.post(1, 5, 2, [_route(2)], layers=2)
    box.words(1)[SEND] = base + 1
    assert poll(0, 0) == (0, 1)
    assert int(box.node_words(1, 0)[REPLY]) == 0 and int(seen[1]) == 0
    node.prepare(PrepareMsg(5, [ShardWork(1, 0, 2, 0, 2)]))
    assert poll(0, 0) == (1, -1) and int(box.node_words(1, 0)[REPLY]) == base + 1
    assert int(seen[1]) == base + 1
    # rows out of the mailbox's range: Python's to answer (it fails the step, naming why)
    base = box.post(0, 6, 2, [_route(2)], layers=2)
    box.rows(0, 0)[0][1] = 9
    node.prepare(PrepareMsg(6, [ShardWork(2, 0, 2, 0, 2)]))
    box.words(0)[SEND] = base + 1
    assert poll(0, 0) == (0, 0)
    server = MailboxServer(box, 0, node.attend)
    server.seen.copy_(seen)
    assert server.answer(0)
    with pytest.raises(RuntimeError, match="memory node 0 failed step 6: IndexError"):
        box.check(0)
