"""codec: lamina.types dataclasses and request messages <-> wire Messages, and remote errors."""
from __future__ import annotations

import pytest
import torch

from lamina.transport import codec
from lamina.transport.wire import Message, MsgKind, WireError, decode, encode_bytes
from lamina.types import AttendMsg, AttendResult, KVChunk, NodeStats, PrepareMsg, ShardWork
from wire_cases import assert_same


def over_wire(msg: Message) -> Message:
    return decode(encode_bytes(msg))


def test_prepare_round_trip():
    for p in (PrepareMsg(3, []), PrepareMsg(-1, [ShardWork(5, 10, 2, 10, 2), ShardWork(6, 0, 0, 0, 7)])):
        m = over_wire(codec.to_message(p))
        assert m.kind == MsgKind.PREPARE and m.tensors == []
        assert codec.from_message(m) == p


def test_attend_and_result_round_trip():
    a = AttendMsg(9, 4, torch.randn(5, 8, 16, dtype=torch.bfloat16),
                  torch.randn(3, 2, 16, dtype=torch.bfloat16), torch.randn(3, 2, 16, dtype=torch.bfloat16),
                  reply_to=2)
    m = over_wire(codec.to_message(a))
    assert (m.kind, m.step_id, m.layer, m.reply_to) == (MsgKind.ATTEND, 9, 4, 2)
    b = codec.from_message(m)
    assert (b.step_id, b.layer, b.reply_to, b.works) == (9, 4, 2, None)
    assert_same([a.q, a.k, a.v], [b.q, b.k, b.v])
    part = AttendMsg(9, 4, a.q[:2], a.k[:1], a.v[:1], reply_to=1, works=(3, 5))
    assert codec.from_message(over_wire(codec.to_message(part))).works == (3, 5)
    r = AttendResult(9, 4, torch.randn(5, 8, 16), torch.tensor([[float("-inf")] * 8] * 5))
    r2 = codec.from_message(over_wire(codec.to_message(r)))
    assert (r2.step_id, r2.layer, r2.span_ns) == (9, 4, None)
    assert_same([r.o, r.lse], [r2.o, r2.lse])
    timed = AttendResult(9, 4, r.o, r.lse, span_ns=(5, 2**62))
    m = codec.to_message(timed)
    assert m.meta == {} and len(m.tensors) == 3  # the span as a tensor: no meta on the hot path
    assert codec.from_message(over_wire(m)).span_ns == (5, 2**62)
    bad = Message(MsgKind.RESULT, 9, 4, tensors=[r.o, r.lse, torch.zeros(3)])
    with pytest.raises(WireError, match="span"):
        codec.from_message(bad)


@pytest.mark.parametrize("kind", [MsgKind.KV, MsgKind.IMPORT])
def test_kv_chunk_round_trip(kind):
    c = KVChunk(7, 256, torch.randn(2, 0, 4, 8), torch.randn(2, 0, 4, 8))
    m = over_wire(codec.to_message(c, kind))
    assert m.kind == kind
    c2 = codec.from_message(m)
    assert (c2.req_id, c2.start_pos) == (7, 256)
    assert_same([c.k, c.v], [c2.k, c2.v])
    with pytest.raises(ValueError):
        codec.to_message(c, MsgKind.ATTEND)


def test_an_8bit_kv_chunk_travels_with_its_scales():
    """k16v8: bfloat16 K without scales, int8 V with [L, n, Hkv] scales; malformed flags are
    a WireError."""
    c = KVChunk(3, 16, torch.randn(2, 5, 4, 8).bfloat16(),
                torch.randint(-127, 128, (2, 5, 4, 8), dtype=torch.int8), None,
                torch.rand(2, 5, 4))
    c2 = codec.from_message(over_wire(codec.to_message(c, MsgKind.IMPORT)))
    assert c2.k_scale is None
    assert_same([c.k, c.v, c.v_scale], [c2.k, c2.v, c2.v_scale])
    m = codec.to_message(c, MsgKind.IMPORT)
    bad = Message(m.kind, meta=dict(m.meta, scales=[True, True]), tensors=m.tensors)
    with pytest.raises(WireError, match="carries 4 tensors"):
        codec.from_message(over_wire(bad))
    bad = Message(m.kind, meta=dict(m.meta, scales="yes"), tensors=m.tensors)
    with pytest.raises(WireError, match="two booleans"):
        codec.from_message(over_wire(bad))


def test_stats_and_requests_round_trip():
    s = NodeStats(1000, 300, 700, 256, 3, 2, 1, 2, shards={4: (0, 200), -11: (17, 100)})
    assert codec.from_message(over_wire(codec.to_message(s))) == s
    assert codec.from_message(over_wire(codec.stats_request())) is None
    assert codec.from_message(over_wire(codec.free_request([3, 1, 2]))) == [3, 1, 2]
    assert codec.from_message(over_wire(codec.export_request(5, 10, 20))) == (5, 10, 20)
    assert codec.from_message(over_wire(codec.cancel_request([9, 4]))) == [9, 4]
    parts = [(-3, 0, 16), (-7, 16, 20)]  # prefix cache entries have negative ids
    assert codec.from_message(over_wire(codec.share_request(5, parts))) == (5, parts)
    assert codec.from_message(over_wire(codec.ok({"freed": [1]}))) == {"freed": [1]}
    assert over_wire(codec.ping()).kind == MsgKind.PING
    assert over_wire(codec.shutdown()).kind == MsgKind.SHUTDOWN


class UnknownRequestLike(LookupError):
    """Stands for an error class the peer knows but this side never registered."""


class OutOfSlotsLike(MemoryError):
    def __init__(self, requested: int, available: int) -> None:
        super().__init__(f"out of KV slots: requested {requested}, {available} free")


class NotAllowed(Exception):
    pass


def remote(exc: BaseException) -> BaseException:
    m = over_wire(codec.to_message(exc))
    assert m.kind == MsgKind.ERROR
    with pytest.raises(BaseException) as info:
        codec.raise_if_error(m)
    assert type(codec.from_message(m)) is type(info.value)
    return info.value


def test_errors_re_raised_from_the_allow_list():
    e = remote(ValueError("bad position 3"))
    assert type(e) is ValueError and str(e) == "bad position 3"
    e = remote(UnknownRequestLike("request 4"))  # nearest allowed base class
    assert type(e) is LookupError and "UnknownRequestLike: request 4" in str(e)
    assert e.remote_type == "UnknownRequestLike"
    e = remote(NotAllowed("x"))  # no allowed class in its MRO but Exception
    assert type(e) is codec.RemoteError and "NotAllowed: x" in str(e)
    codec.register_error(OutOfSlotsLike)
    e = remote(OutOfSlotsLike(5, 2))  # registered; its __init__ takes other arguments
    assert type(e) is OutOfSlotsLike and str(e) == "out of KV slots: requested 5, 2 free"
    with pytest.raises(ValueError):
        codec.register_error(type("ValueError", (Exception,), {}))
    with pytest.raises(TypeError):
        codec.register_error(int)


def test_error_names_are_never_looked_up_outside_the_allow_list():
    for name in ("SystemExit", "KeyboardInterrupt", "os.system", "__import__", "Exception",
                 "builtins.eval", "OutOfMemoryError"):
        m = Message(MsgKind.ERROR, meta={"type": name, "message": "boom"})
        exc = codec.from_message(over_wire(m))
        assert type(exc) is codec.RemoteError and str(exc) == f"{name}: boom"
    assert codec.raise_if_error(codec.ok()) .kind == MsgKind.OK


@pytest.mark.parametrize("msg", [
    Message(MsgKind.PREPARE),
    Message(MsgKind.PREPARE, meta={"works": [[1, 2, 3]]}),
    Message(MsgKind.PREPARE, meta={"works": [[1, 2, 3, 4, "5"]]}),
    Message(MsgKind.PREPARE, meta={"works": [[1, 2, 3, 4, True]]}),
    Message(MsgKind.ATTEND, tensors=[torch.zeros(1)] * 2),
    Message(MsgKind.ATTEND, meta={"works": [1]}, tensors=[torch.zeros(1)] * 3),
    Message(MsgKind.RESULT, tensors=[torch.zeros(1)] * 3),
    Message(MsgKind.KV, meta={"req_id": 1}, tensors=[torch.zeros(1)] * 2),
    Message(MsgKind.IMPORT, meta={"req_id": 1.5, "start_pos": 0}, tensors=[torch.zeros(1)] * 2),
    Message(MsgKind.STATS, meta={"stats": {"capacity_slots": 1}}),
    Message(MsgKind.FREE, meta={"req_ids": "1,2"}),
    Message(MsgKind.EXPORT, meta={"req_id": 1, "start": 0}),
    Message(MsgKind.ERROR, meta={"type": "ValueError"}),
])
def test_malformed_payloads_raise_wire_error(msg):
    with pytest.raises(WireError):
        codec.from_message(over_wire(msg))


def test_unsupported_object():
    with pytest.raises(TypeError):
        codec.to_message(object())
