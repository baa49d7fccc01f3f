"""The shm ring's C++ fast path (lamina/transport/shm_fast.py) against the Python decoder: the
same bytes give the same message or the same refusal, whichever end reads them. The
conformance suite (test_conformance.py) runs every channel test on fast, Python and mixed
ends; here: that the fast path is really taken, how it is switched off, and a differential
fuzz of the reader."""
from __future__ import annotations

import struct

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lamina.transport import shm_fast
from lamina.transport.shm import ShmChannel
from lamina.transport.wire import Message, MsgKind, WireError, encode_bytes
from wire_cases import assert_same

pytestmark = pytest.mark.skipif(shm_fast.load() is None,
                                reason=f"shm fast path not built: {shm_fast.EXTENSION.build_error()}")


def pair(fast_a, fast_b, capacity=1 << 16):
    a = ShmChannel.create(capacity, fast=fast_a)
    return a, ShmChannel.attach(a.spec, fast=fast_b)


def test_the_fast_path_is_taken_by_default_and_writes_what_python_reads():
    a, b = pair(None, False)
    try:
        assert a._writer is not None and b._reader is None
        calls = []
        real = a._writer

        class Spy:
            def __getattr__(self, name):
                calls.append(name)
                return getattr(real, name)

        a._writer = Spy()
        x = torch.randn(3, 5)
        a.send(Message(MsgKind.ATTEND, 7, 3, 2, {"k": [1, "a"]}, [x, torch.arange(4)]))
        got = b.recv(timeout=10)
        assert "send" in calls
        assert (got.kind, got.step_id, got.layer, got.reply_to, got.meta) == \
            (MsgKind.ATTEND, 7, 3, 2, {"k": [1, "a"]})
        assert_same([x, torch.arange(4)], got.tensors)
    finally:
        a.close()
        b.close()


def test_lamina_kernels_torch_turns_it_off_and_requiring_it_then_fails(monkeypatch, kernels):
    kernels("torch")
    a, b = pair(None, None)
    try:
        assert a._writer is None and b._reader is None
        a.send(Message(MsgKind.PING, tensors=[torch.ones(2)]))
        assert b.recv(timeout=10).kind == MsgKind.PING
    finally:
        a.close()
        b.close()
    with pytest.raises(RuntimeError, match="fast path is unavailable"):
        ShmChannel.create(1 << 12, fast=True)


def test_non_contiguous_and_views_take_the_python_encoder():
    a, b = pair(True, True)
    try:
        x = torch.randn(6, 4)
        sent = [x.t(), x[::2], torch.randn(3).conj()]
        a.send(Message(MsgKind.KV, tensors=sent))
        assert_same([t.contiguous() for t in sent], b.recv(timeout=10).tensors)
    finally:
        a.close()
        b.close()


def _outcome(ch: ShmChannel, data: bytes):
    ch.send_raw([data])
    try:
        m = ch._peer.recv(timeout=0.02)
    except WireError as e:
        return ("error", str(e).split(":")[0])
    except TimeoutError:
        return ("incomplete",)
    return ("message", int(m.kind), m.step_id, m.layer, m.reply_to, m.meta,
            [(t.dtype, tuple(t.shape), t.contiguous().view(torch.uint8).tolist()) for t in m.tensors])


_VALID = encode_bytes(Message(MsgKind.RESULT, 5, 9, 1, {"a": 1},
                              [torch.arange(6, dtype=torch.int32).view(2, 3), torch.ones(2)]))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.integers(0, len(_VALID) - 1), st.integers(0, 255)), max_size=4),
       st.integers(0, len(_VALID)))
def test_fast_and_python_readers_agree_on_mutated_messages(flips, cut):
    """Byte flips (header, descriptors, meta, data) and truncations of a valid message: the fast
    reader and the Python decoder return the same message, the same error, or both wait."""
    data = bytearray(_VALID)
    for pos, val in flips:
        data[pos] = val
    data = bytes(data[:cut]) if cut < len(data) else bytes(data)
    outcomes = []
    for fast in (True, False):
        a, b = pair(None, fast)
        a._peer = b
        try:
            outcomes.append(_outcome(a, data))
        finally:
            a.close()
            b.close()
    assert outcomes[0] == outcomes[1]


def test_a_header_stating_more_than_the_ring_goes_to_the_python_decoder():
    """A message bigger than the ring can never lie whole in it: the fast reader leaves it to
    the streaming decoder (the writer streams it in parts)."""
    a, b = pair(True, True, capacity=1 << 12)
    try:
        import threading
        big = torch.randn(10_000)
        t = threading.Thread(target=a.send, args=(Message(MsgKind.KV, tensors=[big]),))
        t.start()
        got = b.recv(timeout=30)
        t.join(30)
        assert_same([big], got.tensors)
        a.send(Message(MsgKind.PING))  # and the next message is on the fast path again
        assert b.recv(timeout=10).kind == MsgKind.PING
    finally:
        a.close()
        b.close()


def test_garbage_never_crashes_the_fast_reader():
    a, b = pair(True, True)
    try:
        a.send_raw([struct.pack("<4sHHqqqIIQ", b"LMNA", 1, 2, 0, 0, 0, 1, 0, 1 << 40)])
        with pytest.raises(WireError):
            b.recv(timeout=5)
        with pytest.raises(WireError, match="corrupt"):
            b.recv(timeout=5)  # the stream stays poisoned, as with the Python decoder
    finally:
        a.close()
        b.close()
