"""shm backend specifics: streaming through tiny rings, resumable partial messages, concurrent
senders, cleanup of segments and doorbell FIFOs, the
plain-data spec. (Cross-process behaviour: test_conformance.py.)"""
from __future__ import annotations

import gc
import os
import threading

import pytest
import torch

from lamina.transport import ChannelClosed, Message, MsgKind, ShmChannel, shm_pair
from lamina.transport.shm import ShmChannelSpec
from lamina.transport.wire import encode, encode_bytes
from wire_cases import assert_same


def files_of(spec: ShmChannelSpec) -> list[str]:
    """Paths of the segments (Linux /dev/shm) and doorbell FIFOs behind ``spec``."""
    paths = []
    for ring in (spec.a_to_b, spec.b_to_a):
        paths += [f"/dev/shm/{ring.name}", ring.data_bell, ring.space_bell]
    return paths


@pytest.mark.parametrize("capacity,spin_us", [(1, 0.0), (97, 100.0), (4096, 0.0)])
def test_tiny_rings_stream_any_message(capacity, spin_us):
    a, b = shm_pair(capacity, spin_us=spin_us)
    msgs = [Message(MsgKind.KV, step_id=i, meta={"i": i}, tensors=[torch.randn(i * 37 % 500)])
            for i in range(40)]
    t = threading.Thread(target=lambda: [a.send(m) for m in msgs])
    t.start()
    got = [b.recv(timeout=60) for _ in msgs]
    t.join()
    for m, g in zip(msgs, got):
        assert g.step_id == m.step_id and g.meta == m.meta
        assert_same(m.tensors, g.tensors)
    a.close()
    b.close()


def test_partial_message_survives_a_timeout():
    a, b = shm_pair(1 << 16)
    m = Message(MsgKind.ATTEND, step_id=4, tensors=[torch.arange(1000)])
    data = encode_bytes(m)
    for cut in (10, 48, 200):  # inside the header, after it, inside the data
        a.send_raw([data[:cut]])
        with pytest.raises(TimeoutError):
            b.recv(timeout=0.05)
        a.send_raw([data[cut:]])
        out = b.recv(timeout=10)
        assert out.step_id == 4 and torch.equal(out.tensors[0], m.tensors[0])
    a.close()
    b.close()


def test_concurrent_senders_keep_messages_whole():
    a, b = shm_pair(4096)
    n, per = 4, 50

    def sender(k):
        for i in range(per):
            a.send(Message(MsgKind.PING, step_id=k, layer=i, tensors=[torch.full((300,), k * 1000 + i)]))

    threads = [threading.Thread(target=sender, args=(k,)) for k in range(n)]
    for t in threads:
        t.start()
    got = [b.recv(timeout=60) for _ in range(n * per)]
    for t in threads:
        t.join()
    for k in range(n):
        mine = [g for g in got if g.step_id == k]
        assert [g.layer for g in mine] == list(range(per))
        assert all(torch.equal(g.tensors[0], torch.full((300,), k * 1000 + g.layer)) for g in mine)
    a.close()
    b.close()


def test_both_directions_at_once():
    """Each end sends ten times the ring size while the other receives (a send blocks while the
    ring is full, so - as with sockets - somebody must be receiving)."""
    a, b = shm_pair(1024)
    big = [torch.randn(5000) for _ in range(10)]
    got_b = []
    threads = [threading.Thread(target=lambda: [b.send(Message(MsgKind.KV, tensors=[x])) for x in big]),
               threading.Thread(target=lambda: got_b.extend(b.recv(timeout=60) for _ in big))]
    for t in threads:
        t.start()
    for x in big:
        a.send(Message(MsgKind.KV, tensors=[x]))
    got_a = [a.recv(timeout=60) for _ in big]
    for t in threads:
        t.join()
    for x, ga, gb in zip(big, got_a, got_b):
        assert torch.equal(ga.tensors[0], x) and torch.equal(gb.tensors[0], x)
    a.close()
    b.close()


def test_close_removes_segments_and_doorbells():
    a, b = shm_pair(4096)
    paths = files_of(a.spec)
    assert all(os.path.exists(p) for p in paths)
    b.close()
    a.close()
    del a, b
    gc.collect()
    assert [p for p in paths if os.path.exists(p)] == []


def test_unclosed_creator_is_cleaned_up_when_collected():
    a = ShmChannel.create(4096)
    spec = a.spec
    b = ShmChannel.attach(spec)
    seg = f"/dev/shm/{spec.a_to_b.name}"
    del a
    gc.collect()
    assert not os.path.exists(seg)
    b.send(Message(MsgKind.PING))  # the mapping stays valid for the survivor
    b.close()


def test_attach_checks():
    a = ShmChannel.create(4096)
    spec = a.spec
    wrong = ShmChannelSpec(spec.name, 8192, spec.bell_dir)
    with pytest.raises(ValueError):
        ShmChannel.attach(wrong)
    a.close()
    with pytest.raises(ChannelClosed):
        ShmChannel.attach(spec)  # the creator is gone
    with pytest.raises(ValueError):
        ShmChannel.create(0)


def test_closed_end_refuses_and_peer_sees_close_after_draining():
    a, b = shm_pair(4096)
    a.send(Message(MsgKind.PING, meta={"last": True}))
    a.close()
    with pytest.raises(ChannelClosed):
        a.send(Message(MsgKind.PING))
    with pytest.raises(ChannelClosed):
        a.recv(timeout=0)
    assert b.recv(timeout=5).meta == {"last": True}
    with pytest.raises(ChannelClosed):
        b.recv(timeout=5)
    with pytest.raises(ChannelClosed):
        b.send(Message(MsgKind.PING))
    b.close()


def test_peer_alive_hook_and_same_process_default():
    a, b = shm_pair(4096)
    assert a.peer_alive() and b.peer_alive()
    a.set_peer_alive(lambda: False)
    assert not a.peer_alive()
    a.set_peer_alive(None)
    assert a.peer_alive()
    a.close()
    b.close()


def test_send_raw_accepts_encoded_buffers():
    a, b = shm_pair(4096)  # the whole message fits: nobody receives while we send
    m = Message(MsgKind.RESULT, tensors=[torch.randn(100), torch.tensor(True)])
    a.send_raw(encode(m))
    assert_same(m.tensors, b.recv(timeout=10).tensors)
    a.close()
    b.close()
