"""A request and its reply in one native call (RingChannel.exchange) over shm rings."""
from __future__ import annotations

import threading

import pytest
import torch

from lamina.transport import Message, MsgKind, shm_pair
from lamina.transport import shm_fast
from lamina.config import KernelConfig
from lamina.transport.local import local_pair

fast = shm_fast.load()
needs_fast = pytest.mark.skipif(fast is None, reason="the ring's C++ fast path does not build here")
WAIT = (50_000_000, 0)  # spin 50 ms (then sleep one wake interval)


@pytest.fixture
def link():
    """``(asker, answerer)``: the test exchanges on the first, a peer thread answers on the
    second."""
    a, b = shm_pair(1 << 16, spin_us=0.0, wake_interval=0.02)
    yield a, b
    a.close()
    b.close()


def _answer(ch, reply: Message | None = None, *, first: Message | None = None):
    """Receive one message on ``ch`` and answer it (``first`` is sent before the reply); the
    thread, and a list that gets what it received."""
    got: list[Message] = []

    def run():
        msg = ch.recv(timeout=5)
        got.append(msg)
        if first is not None:
            ch.send(first)
        ch.send(reply if reply is not None else
                Message(MsgKind.RESULT, msg.step_id, msg.layer, tensors=[msg.tensors[0] * 2,
                                                                         torch.ones(3)]))
    t = threading.Thread(target=run)
    t.start()
    return t, got


def _qkv(n: int = 4) -> list[torch.Tensor]:
    return [torch.randn(n, 3, 8), torch.randn(n, 1, 8), torch.randn(n, 1, 8)]


@needs_fast
@pytest.mark.parametrize("spin", [WAIT, (0, 0), (20_000_000, 16)])
def test_the_reply_comes_back_with_the_call(link, spin):
    """Whether the caller polls, sleeps at once or polls yielding, the reply is taken in the
    call; the peer got the request as sent."""
    a, b = link
    tensors = _qkv()
    t, got = _answer(b)
    sent_ns, reply = a.exchange(MsgKind.ATTEND, 7, 3, 11, tensors, MsgKind.RESULT, *spin)
    t.join()
    assert reply is not None and torch.equal(reply[0], tensors[0] * 2)
    assert torch.equal(reply[1], torch.ones(3))
    (msg,) = got
    assert (msg.kind, msg.step_id, msg.layer, msg.reply_to) == (MsgKind.ATTEND, 7, 3, 11)
    assert all(torch.equal(x, y) for x, y in zip(msg.tensors, tensors))
    assert sent_ns > 0


@needs_fast
@pytest.mark.parametrize("first", [
    Message(MsgKind.OK),  # another kind
    Message(MsgKind.RESULT, 7, 2, tensors=[torch.zeros(1)]),  # another layer
    Message(MsgKind.RESULT, 8, 3, tensors=[torch.zeros(1)]),  # another step
    Message(MsgKind.RESULT, 7, 3, meta={"x": 1}, tensors=[torch.zeros(1)]),  # with meta
])
def test_anything_else_first_is_left_for_recv(link, first):
    """A message that is not the reply stays in the ring, whole: recv() returns it, then the
    reply."""
    a, b = link
    t, _ = _answer(b, first=first)
    _, reply = a.exchange(MsgKind.ATTEND, 7, 3, 0, _qkv(), MsgKind.RESULT, *WAIT)
    t.join()
    assert reply is None
    again = a.recv(timeout=5)
    assert (again.kind, again.step_id, again.layer, again.meta) == \
        (first.kind, first.step_id, first.layer, first.meta)
    late = a.recv(timeout=5)
    assert (late.kind, late.step_id, late.layer) == (MsgKind.RESULT, 7, 3)


@needs_fast
def test_a_reply_later_than_the_wait_is_recvs(link):
    a, b = link
    _, reply = a.exchange(MsgKind.ATTEND, 1, 0, 0, _qkv(), MsgKind.RESULT, 0, 0)
    assert reply is None  # nobody answered within the wait (one wake interval)
    msg = b.recv(timeout=5)
    b.send(Message(MsgKind.RESULT, msg.step_id, msg.layer, tensors=[torch.ones(2)]))
    late = a.recv(timeout=5)
    assert late.kind == MsgKind.RESULT and torch.equal(late.tensors[0], torch.ones(2))


@needs_fast
def test_tensors_the_fast_path_does_not_take_go_the_python_way(link):
    """A non-contiguous tensor (INELIGIBLE) and a message bigger than the ring (NO_ROOM) are
    sent by send(); the reply is then recv()'s."""
    a, b = link
    for tensors in ([torch.randn(8, 4).t()], [torch.randn(1 << 15)]):  # strided; 128 KB > 64 KB
        t = threading.Thread(target=lambda: b.send(Message(
            MsgKind.RESULT, 5, 1, tensors=[b.recv(timeout=5).tensors[0].contiguous()])))
        t.start()
        _, reply = a.exchange(MsgKind.ATTEND, 5, 1, 0, tensors, MsgKind.RESULT, *WAIT)
        assert reply is None
        assert torch.equal(a.recv(timeout=5).tensors[0], tensors[0])  # (streamed: recv first)
        t.join()


@pytest.mark.parametrize("pair", ["local", "python ring"])
def test_a_channel_without_the_fast_path_sends_and_leaves_the_reply_to_recv(pair, kernels):
    if pair == "python ring":
        kernels(KernelConfig(ring="python"))
    a, b = local_pair() if pair == "local" else shm_pair(1 << 16, spin_us=0.0,
                                                           wake_interval=0.02)
    try:
        t, got = _answer(b)
        _, reply = a.exchange(MsgKind.ATTEND, 2, 4, 0, _qkv(), MsgKind.RESULT, *WAIT)
        assert reply is None
        assert a.recv(timeout=5).layer == 4
        t.join()
        assert got[0].kind == MsgKind.ATTEND
    finally:
        a.close()
        b.close()


@needs_fast
def test_a_closed_channel_raises(link):
    from lamina.transport import ChannelClosed
    a, _ = link
    a.close()
    with pytest.raises(ChannelClosed):
        a.exchange(MsgKind.ATTEND, 1, 0, 0, _qkv(), MsgKind.RESULT, *WAIT)
