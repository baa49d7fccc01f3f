"""Conversions between :mod:`lamina.types` dataclasses (and request messages that have no
dataclass) and wire :class:`~lamina.transport.wire.Message` s.

=========  ===================================  ==========================================
kind       built by                             :func:`from_message` returns
=========  ===================================  ==========================================
PREPARE    ``to_message(PrepareMsg)``           ``PrepareMsg`` (works as JSON meta)
ATTEND     ``to_message(AttendMsg)``            ``AttendMsg`` (tensors q, k, v)
RESULT     ``to_message(AttendResult)``         ``AttendResult`` (tensors o, lse)
KV         ``to_message(KVChunk)``              ``KVChunk`` (EXPORT's answer; tensors k, v)
IMPORT     ``to_message(KVChunk, MsgKind.IMPORT)``  ``KVChunk`` (payload to import)
STATS      ``stats_request()`` / ``to_message(NodeStats)``  ``None`` (request) / ``NodeStats``
FREE       ``free_request(req_ids)``            ``list[int]``
FREE       ``free_range_request(req_id, a, b)``  ``(req_id, a, b)`` (one range of one request)
CANCEL     ``cancel_request(step_ids)``          ``list[int]`` (steps to roll back or refuse)
SHARE      ``share_request(dst, parts)``         ``(dst, [(src, start, end), ...])``
EXPORT     ``export_request(req_id, start, end)``  ``(req_id, start, end)``
ERROR      ``to_message(exception)``            the exception instance (see below)
OK/PING/SHUTDOWN  ``ok(meta)``, ``ping()``, ``shutdown()``  the meta dict
=========  ===================================  ==========================================

Errors travel as ``{"type": name, "message": str, "remote_type": original class name}``. The
sender names the nearest class in the exception's MRO that is on the allow-list (built-in
errors plus those added with :func:`register_error`); the receiver instantiates only classes on
its allow-list (never a name lookup of arbitrary classes, never eval) and falls back to
:class:`RemoteError`. Malformed payloads raise :class:`~lamina.transport.wire.WireError`.
"""
from __future__ import annotations

from typing import Any

import torch

from lamina.transport.base import ChannelClosed, PeerDied
from lamina.transport.wire import Message, MsgKind, WireError
from lamina.types import AttendMsg, AttendResult, KVChunk, NodeStats, PrepareMsg, ShardWork

__all__ = ["RemoteError", "register_error", "to_message", "from_message", "free_request",
           "free_range_request", "cancel_request", "share_request",
           "export_request", "stats_request", "shutdown", "ping", "ok", "raise_if_error"]


class RemoteError(RuntimeError):
    """The peer reported an error whose class is not on this side's allow-list."""


_ALLOWED: dict[str, type[BaseException]] = {}


def register_error(cls: type[BaseException]) -> type[BaseException]:
    """Allow ``cls`` to be re-raised from ERROR messages (usable as a class decorator)."""
    if not (isinstance(cls, type) and issubclass(cls, Exception)):
        raise TypeError(f"{cls!r} is not an Exception subclass")
    other = _ALLOWED.get(cls.__name__)
    if other is not None and other is not cls:
        raise ValueError(f"another error class named {cls.__name__!r} is registered: {other!r}")
    _ALLOWED[cls.__name__] = cls
    return cls


for _cls in (ValueError, TypeError, KeyError, IndexError, LookupError, RuntimeError, MemoryError,
             NotImplementedError, TimeoutError, OverflowError, ZeroDivisionError, AssertionError,
             ConnectionError, OSError, WireError, ChannelClosed, PeerDied, RemoteError):
    register_error(_cls)


def _int(meta: dict[str, Any], key: str) -> int:
    v = meta.get(key)
    if type(v) is not int:
        raise WireError(f"meta field {key!r} must be an int, got {v!r}")
    return v


def _ints(v: Any, what: str, n: int | None = None) -> list[int]:
    if not isinstance(v, list) or any(type(x) is not int for x in v) or \
            (n is not None and len(v) != n):
        raise WireError(f"{what} must be a list of {n or ''} ints, got {v!r}")
    return v


def _tensors(msg: Message, n: int) -> list[torch.Tensor]:
    if len(msg.tensors) != n:
        raise WireError(f"{msg.kind.name} carries {n} tensors, got {len(msg.tensors)}")
    return msg.tensors


_STATS_FIELDS = ("capacity_slots", "used_slots", "free_slots", "slab_size", "total_slabs",
                 "used_slabs", "free_slabs", "num_requests", "attend_us")


def result_of(step_id: int, layer: int, tensors: list[torch.Tensor]) -> AttendResult:
    """The ``AttendResult`` a RESULT's tensors (o, lse[, span]) carry."""
    if len(tensors) == 3:
        o, lse, span = tensors
        if span.dtype != torch.int64 or span.shape != (2,):
            raise WireError(f"a RESULT's span is int64 [2], got {span.dtype} {tuple(span.shape)}")
        return AttendResult(step_id, layer, o, lse, tuple(span.tolist()))
    if len(tensors) != 2:
        raise WireError(f"RESULT carries 2 or 3 tensors, got {len(tensors)}")
    return AttendResult(step_id, layer, *tensors)


def to_message(obj: Any, kind: MsgKind | None = None) -> Message:
    """Message for a PrepareMsg, AttendMsg, AttendResult, KVChunk (``kind`` KV or IMPORT),
    NodeStats or an exception (an ERROR message)."""
    if isinstance(obj, PrepareMsg):
        works = [[w.req_id, w.q_start, w.num_q, w.append_start, w.num_append] for w in obj.works]
        return Message(MsgKind.PREPARE, step_id=obj.step_id, meta={"works": works})
    if isinstance(obj, AttendMsg):
        meta = {"works": list(obj.works)} if obj.works is not None else {}
        return Message(MsgKind.ATTEND, obj.step_id, obj.layer, obj.reply_to, meta=meta,
                       tensors=[obj.q, obj.k, obj.v])
    if isinstance(obj, AttendResult):  # the span as a tensor: no meta, no JSON on the hot path
        span = [] if obj.span_ns is None else [torch.tensor(obj.span_ns, dtype=torch.int64)]
        return Message(MsgKind.RESULT, obj.step_id, obj.layer, tensors=[obj.o, obj.lse, *span])
    if isinstance(obj, KVChunk):
        kind = MsgKind.KV if kind is None else kind
        if kind not in (MsgKind.KV, MsgKind.IMPORT):
            raise ValueError(f"a KVChunk travels as KV or IMPORT, not {kind!r}")
        scales = [t is not None for t in (obj.k_scale, obj.v_scale)]
        return Message(kind, meta={"req_id": obj.req_id, "start_pos": obj.start_pos,
                                   "scales": scales},
                       tensors=[obj.k, obj.v] + [t for t in (obj.k_scale, obj.v_scale)
                                                 if t is not None])
    if isinstance(obj, NodeStats):
        stats: dict[str, Any] = {f: getattr(obj, f) for f in _STATS_FIELDS}
        stats["shards"] = [[r, s, n] for r, (s, n) in sorted(obj.shards.items())]
        return Message(MsgKind.STATS, meta={"stats": stats})
    if isinstance(obj, BaseException):
        name = next((c.__name__ for c in type(obj).__mro__ if _ALLOWED.get(c.__name__) is c),
                    RemoteError.__name__)
        return Message(MsgKind.ERROR, meta={"type": name, "message": str(obj),
                                            "remote_type": type(obj).__name__})
    raise TypeError(f"no message encoding for {type(obj).__name__}")


def free_request(req_ids: list[int]) -> Message:
    """FREE: drop these requests' KV (ids the node does not hold are ignored)."""
    return Message(MsgKind.FREE, meta={"req_ids": [int(r) for r in req_ids]})


def free_range_request(req_id: int, start: int, end: int) -> Message:
    """FREE of positions ``start .. end-1`` of ``req_id`` only (after its KV moved away)."""
    return Message(MsgKind.FREE, meta={"req_id": req_id, "start": start, "end": end})


def cancel_request(step_ids: list[int]) -> Message:
    """CANCEL: roll back these steps' appends where prepared, and refuse them from now on."""
    return Message(MsgKind.CANCEL, meta={"step_ids": [int(s) for s in step_ids]})


def share_request(dst: int, parts: list[tuple[int, int, int]]) -> Message:
    """SHARE: shard ``dst`` takes the slots of ``parts`` (:meth:`MemoryNode.share`)."""
    return Message(MsgKind.SHARE, meta={"dst": int(dst),
                                        "parts": [[int(x) for x in p] for p in parts]})


def export_request(req_id: int, start: int, end: int) -> Message:
    """EXPORT: ask for positions ``start .. end-1`` of ``req_id`` (answered with KV)."""
    return Message(MsgKind.EXPORT, meta={"req_id": req_id, "start": start, "end": end})


def stats_request() -> Message:
    """STATS with no payload: ask for the node's NodeStats (answered with STATS + stats)."""
    return Message(MsgKind.STATS)


def shutdown() -> Message:
    return Message(MsgKind.SHUTDOWN)


def ping(meta: dict[str, Any] | None = None) -> Message:
    return Message(MsgKind.PING, meta=dict(meta or {}))


def ok(meta: dict[str, Any] | None = None) -> Message:
    """OK: success reply, optionally with JSON results (e.g. ``{"freed": [...]}``)."""
    return Message(MsgKind.OK, meta=dict(meta or {}))


def _error(msg: Message) -> BaseException:
    name, text = msg.meta.get("type"), msg.meta.get("message")
    remote_type = msg.meta.get("remote_type", name)
    if not isinstance(name, str) or not isinstance(text, str) or not isinstance(remote_type, str):
        raise WireError(f"ERROR meta needs string 'type' and 'message', got {msg.meta!r}")
    cls = _ALLOWED.get(name, RemoteError)
    if cls is RemoteError or remote_type != name:
        text = f"{remote_type}: {text}"
    try:
        exc = cls(text)
    except Exception:  # a registered class with a different constructor
        exc = cls.__new__(cls)
        exc.args = (text,)
    exc.remote_type = remote_type  # type: ignore[attr-defined]
    return exc


def from_message(msg: Message) -> Any:
    """Inverse of the builders above; see the module table for what each kind returns."""
    kind, meta = msg.kind, msg.meta
    if kind == MsgKind.PREPARE:
        works = meta.get("works")
        if not isinstance(works, list):
            raise WireError(f"PREPARE meta needs a 'works' list, got {meta!r}")
        return PrepareMsg(msg.step_id, [ShardWork(*_ints(w, "a work", 5)) for w in works])
    if kind == MsgKind.ATTEND:
        q, k, v = _tensors(msg, 3)
        works = meta.get("works")
        return AttendMsg(msg.step_id, msg.layer, q, k, v, reply_to=msg.reply_to,
                         works=tuple(_ints(works, "a works range", 2)) if works is not None
                         else None)
    if kind == MsgKind.RESULT:
        return result_of(msg.step_id, msg.layer, msg.tensors)
    if kind in (MsgKind.KV, MsgKind.IMPORT):
        scales = meta.get("scales", [False, False])
        if not (isinstance(scales, list) and len(scales) == 2
                and all(isinstance(x, bool) for x in scales)):
            raise WireError(f"a KV chunk's scales flags must be two booleans, got {scales!r}")
        k, v, *rest = _tensors(msg, 2 + sum(scales))
        k_scale = rest.pop(0) if scales[0] else None
        v_scale = rest.pop(0) if scales[1] else None
        return KVChunk(_int(meta, "req_id"), _int(meta, "start_pos"), k, v, k_scale, v_scale)
    if kind == MsgKind.STATS:
        if not meta:
            return None
        stats = meta.get("stats")
        if not isinstance(stats, dict) or not isinstance(stats.get("shards"), list):
            raise WireError(f"STATS meta needs 'stats' with 'shards', got {meta!r}")
        shards = {}
        for entry in stats["shards"]:
            r, s, n = _ints(entry, "a shard", 3)
            shards[r] = (s, n)
        return NodeStats(*(_int(stats, f) for f in _STATS_FIELDS), shards=shards)
    if kind == MsgKind.FREE:
        if "req_ids" not in meta and "req_id" in meta:
            return (_int(meta, "req_id"), _int(meta, "start"), _int(meta, "end"))
        return list(_ints(meta.get("req_ids"), "FREE req_ids"))
    if kind == MsgKind.EXPORT:
        return (_int(meta, "req_id"), _int(meta, "start"), _int(meta, "end"))
    if kind == MsgKind.CANCEL:
        return list(_ints(meta.get("step_ids"), "CANCEL step_ids"))
    if kind == MsgKind.SHARE:
        parts = meta.get("parts")
        if not isinstance(parts, list):
            raise WireError(f"SHARE meta needs a list of 'parts', got {meta!r}")
        return (_int(meta, "dst"), [tuple(_ints(p, "a SHARE part", 3)) for p in parts])
    if kind == MsgKind.ERROR:
        return _error(msg)
    return meta


def raise_if_error(msg: Message) -> Message:
    """Raise the remote exception when ``msg`` is an ERROR reply, else return ``msg``."""
    if msg.kind == MsgKind.ERROR:
        raise _error(msg)
    return msg
