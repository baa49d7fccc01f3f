"""The step mailbox (lamina/transport/mailbox.py): its layout, the host's post, a node's
answers (rows scattered, failures reported as the step's answer), and the host's check."""
import pytest
import torch

from lamina.transport.mailbox import (BASE, FAILED, MISSED, NQ, REPLY, SEND, STATUS, STEP,
                                      TOKENS, Mailbox, MailboxServer, MailboxShape, host_buffer)
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


def test_a_failed_attend_is_the_steps_answer_and_the_host_raises_it():
    box = _box()

    def attend(msg):
        raise ValueError("step 5 is not prepared on this node")

    server = MailboxServer(box, 0, attend)
    base = box.post(1, 5, 1, [_route(0, [0])], layers=3)
    box.words(1)[SEND] = base + 1
    assert server.poll()
    w = box.node_words(1, 0)
    assert int(w[REPLY]) == base + 1 and int(w[STATUS]) == FAILED
    with pytest.raises(RuntimeError, match="memory node 0 failed step 5: ValueError: step 5 is not"):
        box.check(1)
    box.check(1)  # reported once
    box.words(1)[MISSED] = 1
    with pytest.raises(RuntimeError, match="gave up"):
        box.check(1)
