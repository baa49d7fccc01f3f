"""Wire format: layout against an independent struct-built oracle, limits, malformed input,
ownership, and the incremental StreamDecoder."""
from __future__ import annotations

import json
import struct

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lamina.transport.wire import (DEFAULT_LIMITS, SUPPORTED_DTYPES, Message, MsgKind, WireError, WireLimits, decode, encode, encode_bytes, unpack_header)
from lamina.transport.stream import StreamDecoder
from wire_cases import MALFORMED, MALFORMED_MATCH, assert_same, raw_message

HDR = struct.Struct("<4sHHqqqIIQ")
DESC = struct.Struct("<BB6xQ8q")


def test_layout_matches_the_documented_format():
    t = torch.tensor([[1.0, 2.0, 3.0]], dtype=torch.float32)
    meta = {"a": 1}
    data = encode_bytes(Message(MsgKind.ATTEND, step_id=5, layer=2, reply_to=9, meta=meta,
                                tensors=[t]))
    meta_b = json.dumps(meta, separators=(",", ":")).encode()
    start = (48 + 80 + len(meta_b) + 63) // 64 * 64
    assert HDR.unpack_from(data) == (b"LMNA", 1, 2, 5, 2, 9, 1, len(meta_b), start + 64)
    assert DESC.unpack_from(data, 48) == (1, 2, 12, 1, 3, 0, 0, 0, 0, 0, 0)
    assert data[128:128 + len(meta_b)] == meta_b
    assert data[start:start + 12] == struct.pack("<3f", 1.0, 2.0, 3.0)
    assert len(data) == start + 64


def test_struct_built_message_decodes():
    payload = struct.pack("<4i", 7, -1, 0, 2 ** 31 - 1)
    head = raw_message(kind=7, descs=[(5, 2, 16, (2, 2))], meta=b'{"req_id":3}')
    data = head + bytes(-len(head) % 64) + payload + bytes(48)
    m = decode(data)
    assert m.kind == MsgKind.KV and m.meta == {"req_id": 3}
    assert m.tensors[0].tolist() == [[7, -1], [0, 2 ** 31 - 1]]


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_stream_decoder_rejects_malformed_on_header_and_descriptors(case):
    data, dec = MALFORMED[case], StreamDecoder()
    with pytest.raises(WireError, match=MALFORMED_MATCH[case]):
        pos = 0
        while pos < len(data):  # only header + descriptors + meta are there: enough to reject
            view = dec.buffer()
            n = min(len(view), len(data) - pos)
            view[:n] = data[pos:pos + n]
            pos += n
            assert dec.advance(n) is None


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_decode_rejects_malformed(case):
    data = MALFORMED[case]
    with pytest.raises(WireError):
        decode(data + bytes(-len(data) % 64))  # (the stated total may also differ: an error too)


def test_decode_rejects_truncated_and_trailing_bytes():
    data = encode_bytes(Message(MsgKind.KV, tensors=[torch.arange(20)]))
    for cut in (0, 10, 47, 48, 100, len(data) - 1):
        with pytest.raises(WireError):
            decode(data[:cut])
    with pytest.raises(WireError):
        decode(data + b"\0")


def test_receiver_limits_apply_before_allocation():
    m = Message(MsgKind.KV, meta={"x": "y" * 100}, tensors=[torch.zeros(1000)] * 3)
    data = encode_bytes(m)
    for limits in (WireLimits(max_tensors=2), WireLimits(max_tensor_bytes=3999),
                   WireLimits(max_message_bytes=len(data) - 1), WireLimits(max_meta_bytes=50),
                   WireLimits(max_ndim=0)):
        with pytest.raises(WireError):
            decode(data, limits)
        with pytest.raises(WireError):  # and the sender refuses under the same limits
            encode(m, limits)
    assert_same(m.tensors, decode(data, WireLimits(max_tensors=3, max_tensor_bytes=4000)).tensors)


def test_bad_limits_and_header_fields():
    with pytest.raises(ValueError):
        WireLimits(max_ndim=9)
    with pytest.raises(WireError):
        encode(Message(MsgKind.PING, step_id=2 ** 63))
    with pytest.raises(WireError):
        encode(Message(MsgKind.PING, meta={1: "int key"}))
    with pytest.raises(WireError):
        encode(Message(MsgKind.PING, meta={"nan": float("nan")}))
    with pytest.raises(WireError):
        unpack_header(b"LMNA")


def test_ownership_views_and_copies():
    t = torch.arange(16, dtype=torch.int32)
    buf = bytearray(encode_bytes(Message(MsgKind.KV, tensors=[t])))
    view = decode(buf).tensors[0]  # writable buffer: a zero-copy view of it
    copied = decode(buf, copy=True).tensors[0]
    frozen = decode(bytes(buf)).tensors[0]  # read-only input: a private copy
    off = len(buf) - 64
    buf[off:off + 4] = struct.pack("<i", 99)
    assert view[0].item() == 99 and copied[0].item() == 0 and frozen[0].item() == 0
    body = torch.frombuffer(bytearray(buf), dtype=torch.uint8)
    assert decode(body).tensors[0].data_ptr() == body.data_ptr() + off


def test_encode_aliases_contiguous_cpu_tensors():
    t = torch.arange(64, dtype=torch.float32)
    bufs = encode(Message(MsgKind.KV, tensors=[t]))
    t[0] = 42.0  # the encoded buffer is a view: the caller must not modify until sent
    assert decode(b"".join(memoryview(b).cast("B") for b in bufs)).tensors[0][0].item() == 42.0


def test_stream_decoder_any_split():
    msgs = [Message(MsgKind.ATTEND, step_id=i, meta={"i": i} if i % 2 else {},
                    tensors=[torch.randn(i, 3)] * (i % 3)) for i in range(6)]
    stream = b"".join(encode_bytes(m) for m in msgs)
    for chunk in (1, 7, 64, 1000, len(stream)):
        dec, out, pos = StreamDecoder(), [], 0
        while pos < len(stream):
            view = dec.buffer()
            n = min(len(view), chunk, len(stream) - pos)
            view[:n] = stream[pos:pos + n]
            pos += n
            msg = dec.advance(n)
            if msg is not None:
                out.append(msg)
        assert not dec.in_progress
        assert [(m.step_id, m.meta) for m in out] == [(m.step_id, m.meta) for m in msgs]
        for a, b in zip(msgs, out):
            assert_same(a.tensors, b.tensors)


def test_stream_decoder_poisoned_after_error():
    dec = StreamDecoder()
    bad = MALFORMED["bad_magic"]
    dec.buffer()[:48] = bad[:48]
    with pytest.raises(WireError):
        dec.advance(48)
    with pytest.raises(WireError):
        dec.buffer()


@st.composite
def messages(draw):
    tensors = []
    for _ in range(draw(st.integers(0, 4))):
        dtype = draw(st.sampled_from(SUPPORTED_DTYPES))
        shape = draw(st.lists(st.integers(0, 4), max_size=4))
        raw = torch.randint(0, 256, (torch.Size(shape).numel() * torch.empty((), dtype=dtype)
                                     .element_size(),), dtype=torch.uint8)
        tensors.append(raw.view(dtype).reshape(shape) if dtype != torch.bool else
                       (raw % 2).view(torch.bool).reshape(shape))
    meta = draw(st.dictionaries(st.text(max_size=5), st.integers(-10 ** 6, 10 ** 6) | st.text(max_size=5),
                                max_size=3))
    ints = st.integers(-2 ** 63, 2 ** 63 - 1)
    return Message(draw(st.sampled_from(list(MsgKind))), draw(ints), draw(ints), draw(ints), meta,
                   tensors)


@settings(max_examples=150, deadline=None)
@given(messages())
def test_round_trip_property(m):
    out = decode(encode_bytes(m))
    assert (out.kind, out.step_id, out.layer, out.reply_to, out.meta) == \
        (m.kind, m.step_id, m.layer, m.reply_to, m.meta)
    assert_same(m.tensors, out.tensors)


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_corrupted_bytes_raise_only_wire_error(data):
    m = Message(MsgKind.RESULT, 1, 2, 3, {"k": [1, 2]}, [torch.randn(2, 3), torch.arange(3)])
    buf = bytearray(encode_bytes(m))
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, 300))  # header, descriptors and meta
        buf[i] = data.draw(st.integers(0, 255))
    cut = data.draw(st.sampled_from([len(buf), data.draw(st.integers(0, len(buf)))]))
    limits = WireLimits(max_tensor_bytes=1 << 16, max_message_bytes=1 << 17)
    try:
        decode(bytes(buf[:cut]), limits)
    except WireError:
        pass


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_tensors_are_sent_from_host_and_arrive_on_cpu():
    t = torch.randn(5, 7, device="cuda", dtype=torch.bfloat16)
    out = decode(encode_bytes(Message(MsgKind.ATTEND, tensors=[t, t.t()])))
    assert all(x.device.type == "cpu" for x in out.tensors)
    assert torch.equal(out.tensors[0], t.cpu()) and torch.equal(out.tensors[1], t.t().cpu())


def test_default_limits_are_documented_values():
    assert DEFAULT_LIMITS == WireLimits(64, 8, 4 << 30, 8 << 30, 4 << 20)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=600))
def test_arbitrary_bytes_decode_to_a_message_or_a_wire_error(data):
    """The decoder, whole and incremental, on arbitrary bytes: a Message or WireError, never
    another exception, and nothing allocated past the limits (small limits here)."""
    small = WireLimits(max_tensors=4, max_tensor_bytes=1 << 12, max_message_bytes=1 << 14,
                       max_meta_bytes=256)
    try:
        decode(data, small)
    except WireError:
        pass
    dec = StreamDecoder(small)
    pos = 0
    try:
        while pos < len(data):
            view = dec.buffer()
            n = min(len(view), len(data) - pos, 7)  # odd-sized pieces
            view[:n] = data[pos:pos + n]
            view.release()
            pos += n
            dec.advance(n)
    except WireError:
        pass


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 400), st.integers(0, 255)), max_size=6))
def test_mutated_valid_messages_decode_or_fail_cleanly(flips):
    """Byte flips anywhere in a valid message (header, descriptors, meta, data)."""
    data = bytearray(encode_bytes(Message(MsgKind.RESULT, 3, 1, 2, {"k": [1, 2]},
                                          [torch.arange(6).view(2, 3), torch.ones(4)])))
    for pos, val in flips:
        data[pos % len(data)] = val
    try:
        msg = decode(bytes(data))
    except WireError:
        return
    assert isinstance(msg, Message) and all(isinstance(t, torch.Tensor) for t in msg.tensors)
