"""The step mailbox (lamina/transport/mailbox.py): its layout, the host's post, a node's
answers (rows scattered, failures reported as the step's answer), and the host's check."""
import pytest
import torch

from lamina.errors import NodeFailure
from lamina.transport.mailbox import (BASE, FAILED, GONE, MISSED, NQ, REPLY, SEND, STATUS, STEP,
                                      TOKENS, Mailbox, MailboxServer, MailboxShape, NotReady,
                                      SharedMailbox, host_buffer, map_shared)
from lamina.types import AttendResult, NodeRoute

SHAPE = MailboxShape(slots=2, nodes=2, tokens=5, heads=3, kv_heads=1, dim=4)


def _route(node, q_rows, kv_rows=None):
    r = NodeRoute.__new__(NodeRoute)
    r.node, r.works = node, []
    r.q_rows = torch.tensor(q_rows, dtype=torch.long)
    r.kv_rows = torch.tensor(q_rows if kv_rows is None else kv_rows, dtype=torch.long)
    r.span = None
    return r


def _box(shape=SHAPE):
    return Mailbox(shape, host_buffer(shape))


def test_regions_are_disjoint_line_aligned_and_inside_the_buffer():
    box = _box()
    regions = []
    for slot in range(SHAPE.slots):
        regions += [box.words(slot), *box.qkv(slot)]
        for n in range(SHAPE.nodes):
            regions += [box.node_words(slot, n), *box.rows(slot, n), box.error(slot, n),
                        *box.landing(slot, n)]
    base = box.buffer.data_ptr()
    spans = sorted((t.data_ptr() - base, t.data_ptr() - base + t.numel() * t.element_size())
                   for t in regions)
    assert all(a % 64 == 0 for a, _ in spans)
    assert all(b1 <= a2 for (_, b1), (a2, _) in zip(spans, spans[1:]))
    assert spans[-1][1] <= SHAPE.nbytes() == box.buffer.numel()
    with pytest.raises(ValueError, match="slot 2 out of range"):
        box.words(2)
    with pytest.raises(ValueError, match="node 2 out of range"):
        box.landing(0, 2)
    with pytest.raises(ValueError, match="needs uint8"):
        Mailbox(SHAPE, torch.zeros(8, dtype=torch.uint8))


def test_post_writes_the_header_and_clears_the_landing():
    box = _box()
    o, lse = box.landing(1, 0)
    o.fill_(7)
    assert box.post(1, step_id=42, tokens=3, routes=[_route(0, [0, 2]), _route(1, [1], [])],
                    layers=4) == 0
    assert box.post(1, 43, 3, [_route(0, [0, 1, 2])], 4) == 4  # BASE grows by the layers
    words = box.words(1)
    assert [int(words[i]) for i in (STEP, TOKENS, BASE)] == [43, 3, 4]
    assert int(box.node_words(1, 0)[NQ]) == 3 and int(box.node_words(1, 1)[NQ]) == 0
    assert torch.equal(box.rows(1, 0)[0][:3], torch.tensor([0, 1, 2]))
    assert float(o.abs().sum()) == 0 and bool(torch.isinf(lse).all())
    assert box.post(0, 1, 1, [], 4) == 0  # slots count on their own
    with pytest.raises(ValueError, match="does not fit"):
        box.post(0, 2, 6, [], 4)


def test_server_answers_each_send_once_with_its_rows():
    box = _box()
    calls = []

    def attend(msg):
        calls.append(msg)
        return AttendResult(msg.step_id, msg.layer, msg.q + 1, msg.q[..., 0] * 0 + msg.layer)

    server = MailboxServer(box, 1, attend)
    other = MailboxServer(box, 0, attend)
    base = box.post(0, 9, 4, [_route(1, [3, 1], [1])], layers=2)
    q, k, v = box.qkv(0)
    q.copy_(torch.randn_like(q))
    k.copy_(torch.randn_like(k))
    assert not server.poll()  # nothing sent yet
    words = box.words(0)
    words[SEND] = base + 2  # layer 1's q/k/v are in
    assert server.poll() and not server.poll()
    msg = calls[0]
    assert (msg.step_id, msg.layer) == (9, 1)
    assert torch.equal(msg.q, q[[3, 1]]) and torch.equal(msg.k, k[[1]])
    o, lse = box.landing(0, 1)
    assert torch.equal(o[[3, 1]], q[[3, 1]] + 1) and torch.equal(lse[[3, 1]], torch.ones(2, 3))
    assert bool(torch.isinf(lse[[0, 2, 4]]).all()) and float(o[[0, 2, 4]].abs().sum()) == 0
    assert int(box.node_words(0, 1)[REPLY]) == base + 2
    assert other.poll() and len(calls) == 1  # a node with no rows answers without attending
    assert int(box.node_words(0, 0)[REPLY]) == base + 2
    box.check(0)


@pytest.mark.parametrize("error, status, raised", [
    (ValueError("step 5 is not prepared on this node"), FAILED, RuntimeError),
    (NodeFailure("memory node 0 is gone"), GONE, NodeFailure)])  # a stand-in's: the node died
def test_a_failed_attend_is_the_steps_answer_and_the_host_raises_it(error, status, raised):
    box = _box()

    def attend(msg):
        raise error

    server = MailboxServer(box, 0, attend)
    base = box.post(1, 5, 1, [_route(0, [0])], layers=3)
    box.words(1)[SEND] = base + 1
    assert server.poll()
    w = box.node_words(1, 0)
    assert int(w[REPLY]) == base + 1 and int(w[STATUS]) == status
    with pytest.raises(raised, match=f"memory node 0 failed step 5: {type(error).__name__}: "
                                     f"{error}"):
        box.check(1)
    box.check(1)  # reported once
    box.words(1)[MISSED] = 1
    with pytest.raises(NodeFailure, match="gave up"):  # a node stopped answering
        box.check(1)


def _echo(msg):
    return AttendResult(msg.step_id, msg.layer, msg.q * 2, msg.q[..., 0] * 0)


def test_a_failed_layer_fails_the_step_even_when_later_layers_answer():
    box = _box()
    fail = {1}

    def attend(msg):
        if msg.layer in fail:
            raise ValueError(f"layer {msg.layer} broke")
        return _echo(msg)

    server = MailboxServer(box, 0, attend)
    base = box.post(0, 3, 1, [_route(0, [0])], layers=3)
    for layer in range(3):
        box.words(0)[SEND] = base + layer + 1
        assert server.poll()
    with pytest.raises(RuntimeError, match="memory node 0 failed step 3: ValueError: layer 1"):
        box.check(0)
    fail.clear()
    base = box.post(0, 4, 1, [_route(0, [0])], layers=3)  # the next step starts clean
    box.words(0)[SEND] = base + 1
    assert server.poll()
    box.check(0)


def test_not_ready_is_polled_again_then_answered_or_timed_out():
    box = _box()
    ready = []

    def attend(msg):
        if not ready:
            raise NotReady(f"step {msg.step_id} is not prepared on this node")
        return _echo(msg)

    server = MailboxServer(box, 0, attend)
    base = box.post(0, 8, 2, [_route(0, [0, 1])], layers=2)
    box.words(0)[SEND] = base + 1
    assert not server.poll() and not server.poll()  # left for later, not answered
    assert int(box.node_words(0, 0)[REPLY]) == 0
    ready.append(True)
    assert server.poll() and int(box.node_words(0, 0)[REPLY]) == base + 1
    box.check(0)

    ready.clear()
    server.ready_timeout_s = 0.0  # never ready in time: FAILED with what it waited for
    box.words(0)[SEND] = base + 2
    assert server.poll()
    with pytest.raises(RuntimeError, match="step 8 was not ready within 0 s: step 8 is not"):
        box.check(0)


def test_a_server_starts_after_what_its_node_index_answered():
    """A node that takes a dead one's place (or attaches late) answers only new SENDs."""
    box = _box()
    base = box.post(0, 1, 1, [_route(0, [0])], layers=2)
    box.words(0)[SEND] = base + 1
    box.node_words(0, 0)[REPLY] = base + 1  # answered by whoever served index 0 before
    calls = []
    server = MailboxServer(box, 0, lambda m: calls.append(m) or _echo(m))
    assert not server.poll() and calls == []
    box.words(0)[SEND] = base + 2
    assert server.poll() and [m.layer for m in calls] == [1]


def test_shape_travels_as_plain_data():
    shape = MailboxShape(2, 3, 16, 9, 3, 64, torch.bfloat16)
    assert MailboxShape.from_meta(shape.to_meta()) == shape
    with pytest.raises(ValueError, match="dtype 'Linear'"):
        MailboxShape.from_meta({**shape.to_meta(), "dtype": "Linear"})


_CHILD = """
import json, sys, time
import torch
from lamina.transport.mailbox import MailboxServer, map_shared
from lamina.types import AttendResult
box = map_shared(json.loads(sys.argv[1]))
server = MailboxServer(box, 1, lambda m: AttendResult(m.step_id, m.layer, m.q + 5,
                                                      m.q[..., 0] * 0 + 3))
deadline = time.monotonic() + 60
while not server.poll() and time.monotonic() < deadline:
    time.sleep(0.001)
"""


def test_another_process_maps_the_shared_mailbox_and_answers_through_it():
    import json
    import subprocess
    import sys

    shared = SharedMailbox(SHAPE)
    box = Mailbox(SHAPE, shared.buffer)
    child = subprocess.Popen([sys.executable, "-c", _CHILD, json.dumps(shared.handle)])
    try:
        base = box.post(1, 6, 2, [_route(1, [1, 0])], layers=1)
        q, _, _ = box.qkv(1)
        q.copy_(torch.randn_like(q))
        box.words(1)[SEND] = base + 1
        assert child.wait(timeout=120) == 0
    finally:
        child.kill()
        shared.close()
    assert int(box.node_words(1, 1)[REPLY]) == base + 1
    o, lse = box.landing(1, 1)
    assert torch.equal(o[:2], q[:2] + 5) and torch.equal(lse[:2], torch.full((2, 3), 3.0))
    box.check(1)
    with pytest.raises((FileNotFoundError, ValueError)):  # closed: no process maps it any more
        map_shared(shared.handle)
