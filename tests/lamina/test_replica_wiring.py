"""The wiring under compute replicas in processes, in one process: a memory node's peer
channels (OPEN, ATTEND replies routed by ``reply_to``) and STEP messages carrying sampling
uniforms."""
import threading

import pytest
import torch

from lamina.types import NodeRoute
from lamina.memnode import MemoryNode
from lamina.memnode.server import NodeServer
from lamina.transport import codec
from lamina.transport.endpoint import SPIN_US, connect
from lamina.transport.node_client import RemoteNode
from lamina.transport.shm import shm_pair
from lamina.transport.step_codec import parse_step, step_message, step_uniforms
from lamina.transport.wire import MsgKind, WireError, decode, encode_bytes
from lamina.types import (AttendMsg, AttentionSpec, PrepareMsg, SamplingParams, Segment,
                          ShardWork, StepPlan)

SPEC = AttentionSpec(layer=0, num_heads=2, num_kv_heads=1, head_dim=4, scale=0.5)


def _qkv(n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, 2, 4, generator=g), torch.randn(n, 1, 4, generator=g),
            torch.randn(n, 1, 4, generator=g))


@pytest.fixture
def served():
    """A NodeServer on one end of a pair, in a thread; the engine's RemoteNode on the other."""
    engine_end, node_end = shm_pair(capacity=1 << 16)
    server = NodeServer(MemoryNode([SPEC], 64, slab_size=4))
    thread = threading.Thread(target=server.serve, args=(node_end,), daemon=True)
    thread.start()
    client = RemoteNode(engine_end, None, "memory node 0")
    yield server, client
    client.close()
    thread.join(5)
    assert not thread.is_alive()


@pytest.mark.parametrize("kind", ["shm", "tcp"])
def test_attend_replies_go_to_the_reply_to_peer(served, kind):
    server, client = served
    peers = [connect(client.open_peer(i, kind)) for i in range(2)]
    assert [p.__class__.__name__ for p in peers] == [f"{kind.capitalize()}Channel"] * 2
    assert sorted(server.peers) == [0, 1]
    works = [ShardWork(7, 0, 3, 0, 3)]
    peers[0].send(codec.to_message(PrepareMsg(1, works)))
    assert peers[0].recv(5).kind == MsgKind.OK  # other replies go back to the sender
    q, k, v = _qkv(3, 0)
    peers[0].send(codec.to_message(AttendMsg(1, 0, q, k, v, reply_to=1)))
    res = codec.from_message(peers[1].recv(5))
    ref = MemoryNode([SPEC], 64, slab_size=4)
    ref.prepare(PrepareMsg(1, works))
    want = ref.attend(AttendMsg(1, 0, q, k, v))
    assert (res.step_id, res.layer) == (1, 0)
    assert torch.equal(res.o, want.o) and torch.equal(res.lse, want.lse)

    # an unknown reply_to is an ERROR to the sender and changes nothing: the step goes on
    peers[0].send(codec.to_message(PrepareMsg(2, [ShardWork(7, 3, 1, 3, 1)])))
    assert peers[0].recv(5).kind == MsgKind.OK
    peers[0].send(codec.to_message(AttendMsg(2, 0, *_qkv(1, 1), reply_to=5)))
    error = peers[0].recv(5)
    assert (error.kind, error.step_id) == (MsgKind.ERROR, 2)  # filed under its step
    with pytest.raises(ValueError, match="reply_to 5: no such peer"):
        codec.raise_if_error(error)
    peers[1].send(codec.to_message(AttendMsg(2, 0, *_qkv(1, 1), reply_to=0)))
    assert codec.from_message(peers[0].recv(5)).o.shape == (1, 2, 4)
    # the engine's own channel still answers, and FREE with wait is done when it returns
    assert client.stats().used_slots == 4
    client.free([7], wait=True)
    assert client.stats().used_slots == 0
    # a node error names its step and layer too
    peers[0].send(codec.to_message(AttendMsg(99, 3, *_qkv(1, 1), reply_to=0)))
    error = peers[0].recv(5)
    assert (error.kind, error.step_id, error.layer) == (MsgKind.ERROR, 99, 3)
    # a peer that goes away is forgotten
    peers[1].close()
    for _ in range(100):
        if 1 not in server.peers:
            break
        threading.Event().wait(0.05)
    assert sorted(server.peers) == [0]
    peers[0].close()


def test_a_peer_s_mailbox_is_served_until_its_link_ends(served):
    """MAILBOX on a peer channel: the node serves that step mailbox from a thread (an ATTEND
    through it equals one over the ring); a bad handle is an ERROR and the node serves on; the
    peer's link ending stops the thread."""
    from lamina.transport.mailbox import REPLY, SEND, Mailbox, MailboxShape, SharedMailbox
    from lamina.transport.wire import Message

    server, client = served
    peer = connect(client.open_peer(0, "shm"))
    shape = MailboxShape(1, 1, 4, 2, 1, 4)
    shared = SharedMailbox(shape)
    box = Mailbox(shape, shared.buffer)
    peer.send(Message(MsgKind.MAILBOX, step_id=-2, meta={"path": "/nonexistent", "node": 0,
                                                         "shape": shape.to_meta()}))
    error = peer.recv(5)
    assert (error.kind, error.step_id) == (MsgKind.ERROR, -2)
    with pytest.raises(OSError, match="No such file"):
        codec.raise_if_error(error)
    peer.send(Message(MsgKind.MAILBOX, meta={**shared.handle, "node": 0}))
    assert peer.recv(5).kind == MsgKind.OK and 0 in server.mailboxes
    works = [ShardWork(7, 0, 3, 0, 3)]
    peer.send(codec.to_message(PrepareMsg(1, works)))
    assert peer.recv(5).kind == MsgKind.OK
    r = NodeRoute.__new__(NodeRoute)
    r.node, r.works, r.span, r.q_rows = 0, works, None, torch.arange(3)
    r.kv_rows = r.q_rows
    base = box.post(0, 1, 3, [r], layers=1)
    q, k, v = box.qkv(0)
    for t, new in zip((q[:3], k[:3], v[:3]), _qkv(3, 0)):
        t.copy_(new)
    box.words(0)[SEND] = base + 1
    for _ in range(200):
        if int(box.node_words(0, 0)[REPLY]) == base + 1:
            break
        threading.Event().wait(0.01)
    box.check(0)
    ref = MemoryNode([SPEC], 64, slab_size=4)
    ref.prepare(PrepareMsg(1, works))
    want = ref.attend(AttendMsg(1, 0, *_qkv(3, 0)))
    o, lse = box.landing(0, 0)
    assert torch.equal(o[:3], want.o) and torch.equal(lse[:3], want.lse)
    loop = server.mailboxes[0][1]
    peer.close()
    for _ in range(100):
        if 0 not in server.mailboxes:
            break
        threading.Event().wait(0.05)
    assert 0 not in server.mailboxes and not loop._thread.is_alive()
    shared.close()


def test_step_message_carries_uniforms_over_the_wire():
    plan = StepPlan(4, 1, [Segment(9, 0, 2)], torch.tensor([5, 6]), torch.tensor([0, 1]),
                    torch.tensor([1]))
    route = NodeRoute(0, [ShardWork(9, 0, 2, 0, 2)], torch.arange(2), torch.arange(2))
    params = [SamplingParams(temperature=0.7, seed=1)]
    u = torch.tensor([0.25])
    msg = decode(encode_bytes(step_message(plan, [route], [9], params, u)))
    got_plan, routes, req_ids, got_params = parse_step(msg)
    assert (got_plan.step_id, got_plan.micro_batch, req_ids, got_params) == (4, 1, [9], params)
    assert torch.equal(step_uniforms(msg), u)
    assert step_uniforms(decode(encode_bytes(step_message(plan, [route], [9], params)))) is None
    bad = step_message(plan, [route], [9], params, torch.tensor([0.1, 0.2]))
    with pytest.raises(WireError, match="one value per sample row"):
        step_uniforms(bad)


@pytest.mark.parametrize("spin", [False, True])
def test_a_spinning_node_polls_only_its_peer_links(spin):
    """A node alone on its core polls its replicas' (data) links forever; its control link
    and every link of a node that shares its core spin briefly, then sleep."""
    engine_end, node_end = shm_pair(capacity=1 << 16)
    server = NodeServer(MemoryNode([SPEC], 64, slab_size=4),
                        spin_us=float("inf") if spin else SPIN_US)
    thread = threading.Thread(target=server.serve, args=(node_end,), daemon=True)
    thread.start()
    client = RemoteNode(engine_end, None, "memory node 0")
    try:
        peer = connect(client.open_peer(0, "shm"))
        node_side = server.peers[0].channel()
        assert (node_side._spin_s == float("inf")) is spin
        assert node_end._spin_s != float("inf")  # control
        peer.close()
    finally:
        client.close()
        thread.join(5)
    assert not thread.is_alive()
