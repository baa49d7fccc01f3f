"""The ring protocol over *mirrored* memory, as RDMA runs it: each end has its own copy of
both rings and sees the peer's writes only through ``store`` and ``publish``. A fake memory
that copies on those two calls (no shared mapping) proves that the protocol publishes all it
must, on the Python path and on the C++ fast path, so only the verbs glue is left for a
device. Also: selecting RDMA where it cannot run fails at once, naming what is missing."""
from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from lamina.config import deployment_config
from lamina.deployment import start_deployment
from lamina.transport import ChannelClosed, Message, MsgKind, rdma, shm_fast
from lamina.transport.endpoint import link_kind
from lamina.transport.ring import RingChannel
from lamina.transport.ring_memory import CTL_BYTES, PollBell, RingMemory


class MirrorRing(RingMemory):
    """One end's private copy of a ring; ``peer`` is the other end's copy of the same ring."""

    mirrored = True

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.buf = np.zeros(CTL_BYTES + capacity, dtype=np.uint8)
        mv = memoryview(self.buf)
        self.ctl = mv[:CTL_BYTES].cast("Q")
        self.data = mv[CTL_BYTES:]
        self.ctl_addr = int(self.buf.ctypes.data)
        self.data_addr = self.ctl_addr + CTL_BYTES
        self.data_bell, self.space_bell = PollBell(), PollBell()
        self.peer: MirrorRing | None = None
        self.published = 0

    def store(self, word: int, value: int) -> None:
        self.ctl[word] = value
        self.peer.ctl[word] = value

    def publish(self, start: int, end: int) -> None:
        cap = self.capacity
        self.published += end - start
        while start < end:
            pos = start % cap
            n = min(end - start, cap - pos)
            self.peer.data[pos:pos + n] = self.data[pos:pos + n]
            start += n

    def release(self, unlink: bool) -> None:
        pass


class MirrorChannel(RingChannel):
    def peer_alive(self) -> bool:
        return True


def mirror_pair(capacity: int, fast_a, fast_b) -> tuple[MirrorChannel, MirrorChannel]:
    a_tx, a_rx, b_tx, b_rx = (MirrorRing(capacity) for _ in range(4))
    a_tx.peer, b_rx.peer = b_rx, a_tx  # a -> b
    b_tx.peer, a_rx.peer = a_rx, b_tx  # b -> a
    return (MirrorChannel(a_tx, a_rx, fast=fast_a, spin_us=50),
            MirrorChannel(b_tx, b_rx, fast=fast_b, spin_us=50))


FAST = shm_fast.load()
PATHS = {"python": (None, None), "fast": (FAST, FAST), "mixed": (FAST, None)}


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("capacity", [1 << 12, 1 << 20])
def test_messages_cross_mirrored_rings_whole(path, capacity):
    """Messages smaller and larger than the ring (streamed), both directions, every dtype
    path the fast path takes; the receiving copy only ever gets published bytes."""
    if "fast" in path or path == "mixed":
        if FAST is None:
            pytest.skip("the C++ ring fast path did not build")
    a, b = mirror_pair(capacity, *PATHS[path])
    sizes = [0, 1, 100, 1000, capacity // 4, 3 * capacity]  # elements of float32
    msgs = [Message(MsgKind.ATTEND, step_id=i, layer=i % 3, meta={"i": i},
                    tensors=[torch.randn(n), torch.arange(7, dtype=torch.int64)])
            for i, n in enumerate(sizes)]

    def echo():
        for _ in msgs:
            m = b.recv(timeout=30)
            b.send(Message(MsgKind.RESULT, m.step_id, m.layer, meta=m.meta, tensors=m.tensors))

    t = threading.Thread(target=echo)
    t.start()
    outs = []
    for m in msgs:  # one at a time: both directions stream through rings smaller than a message
        a.send(m)
        outs.append(a.recv(timeout=30))
    t.join(30)
    for m, o in zip(msgs, outs):
        assert (o.kind, o.step_id, o.layer, o.meta) == (MsgKind.RESULT, m.step_id, m.layer, m.meta)
        for x, y in zip(m.tensors, o.tensors):
            assert torch.equal(x, y)
    assert a._tx.published > 3 * capacity * 4  # the big message went through the ring in parts
    a.close()
    with pytest.raises(ChannelClosed):
        b.recv(timeout=5)  # the close flag reached the peer's copy too
    b.close()


def test_rdma_unavailable_here_names_what_is_missing():
    why = rdma.unavailable()
    if why is None:
        pytest.skip("pyverbs and an RDMA device are present: the conformance suite runs rdma")
    assert "pyverbs" in why or "RDMA device" in why
    with pytest.raises(rdma.RdmaUnavailable, match="rdma"):
        rdma.require()
    with pytest.raises(rdma.RdmaUnavailable):
        rdma.rdma_pair(1 << 12)
    with pytest.raises(ValueError, match="rdma"):  # refused before anything starts
        start_deployment(deployment_config("no-such-model", placement="procs", transport="rdma"))
    where = {"node_id": "n", "ip": "127.0.0.1"}
    with pytest.raises(rdma.RdmaUnavailable):
        link_kind("rdma", where, where)
