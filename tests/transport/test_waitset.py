"""One thread waiting on several shm rings and on posts from other threads (WaitSet)."""
from __future__ import annotations

import threading
import time

import pytest
import torch

from lamina.transport import Message, MsgKind, PeerDied, shm_pair
from lamina.transport import shm_fast
from lamina.transport.waitset import POSTED, TIMED_OUT, WaitSet

fast = shm_fast.load()
pytestmark = pytest.mark.skipif(fast is None, reason="the ring's C++ fast path does not build here")


@pytest.fixture
def links():
    """Three links: the test sends on ``[i][0]``, the waiter receives on ``[i][1]``."""
    pairs = [shm_pair(1 << 16, spin_us=0.0, wake_interval=0.01) for _ in range(3)]
    yield pairs
    for a, b in pairs:
        a.close()
        b.close()


def _later(delay: float, fn) -> threading.Thread:
    t = threading.Thread(target=lambda: (time.sleep(delay), fn()))
    t.start()
    return t


@pytest.mark.parametrize("spin_us", [0.0, 20.0, float("inf")])
def test_returns_the_ring_that_has_data(links, spin_us):
    ws = WaitSet(fast, spin_us)
    rings = WaitSet.handles([b for _, b in links])
    assert rings is not None
    assert ws.wait(rings, ws.posted, 0.0) == TIMED_OUT  # nothing yet, no time to wait
    msg = Message(MsgKind.RESULT, 3, 4, tensors=[torch.arange(5.0)])
    links[2][0].send(msg)
    assert ws.wait(rings, ws.posted, 1.0) == 2
    got = links[2][1].recv()
    assert got.step_id == 3 and torch.equal(got.tensors[0], msg.tensors[0])
    assert ws.wait(rings, ws.posted, 0.0) == TIMED_OUT  # taken: nothing left


@pytest.mark.parametrize("spin_us", [0.0, float("inf")])
def test_a_send_wakes_a_sleeping_waiter(links, spin_us):
    """The waiter sleeps on the doorbells (spin 0) or polls: a send 50 ms later ends the wait
    with that ring, well before the 5 s timeout (the poll()'s 1 s cap would show as TIMED_OUT)."""
    ws = WaitSet(fast, spin_us)
    rings = WaitSet.handles([b for _, b in links])
    t = _later(0.05, lambda: links[1][0].send(Message(MsgKind.OK)))
    try:
        assert ws.wait(rings, ws.posted, 5.0) == 1
    finally:
        t.join()
    assert links[1][1].recv().kind == MsgKind.OK


def test_a_post_wakes_a_sleeping_waiter(links):
    ws = WaitSet(fast, 0.0)
    rings = WaitSet.handles([b for _, b in links])
    seen = ws.posted
    t = _later(0.05, ws.post)
    try:
        assert ws.wait(rings, seen, 5.0) == POSTED
    finally:
        t.join()
    assert ws.posted == seen + 1
    assert ws.wait(rings, seen, 0.0) == POSTED  # a post seen before the wait ends it at once
    assert ws.wait(rings, ws.posted, 0.0) == TIMED_OUT


def test_check_peer_raises_once_the_peer_is_gone_and_drained(links):
    a, b = links[0]
    a.send(Message(MsgKind.OK))
    a.close()
    b.check_peer()  # a message is still there to read
    assert b.recv().kind == MsgKind.OK
    with pytest.raises((ConnectionError, PeerDied)):
        b.check_peer()


def test_channels_without_a_ring_have_no_handle():
    from lamina.transport.local import local_pair
    assert WaitSet.handles([local_pair()[0]]) is None
