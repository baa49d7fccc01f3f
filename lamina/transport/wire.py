"""The one wire protocol of Lamina: a fixed binary header, tensor descriptors, a small JSON
control block, then raw tensor bytes. No pickle anywhere.

Layout of one message (all integers little endian)::

    header      48 bytes  struct "<4sHHqqqIIQ": magic b"LMNA", version (u16), kind (u16),
                          step_id (i64), layer (i64), reply_to (i64), tensor count (u32),
                          meta length (u32), total message length in bytes (u64)
    descriptors 80 bytes per tensor, struct "<BB6xQ8q": dtype code (u8), ndim (u8), byte length
                          (u64), shape (8 x i64; dims past ndim are 0)
    meta        meta-length bytes of UTF-8 JSON (a JSON object; 0 bytes means {})
    padding     to a multiple of ALIGN (64) bytes from the message start
    tensor i    its raw bytes (C order), then padding to a multiple of ALIGN

Every length is checked against :class:`WireLimits` *before* anything is read past it or
allocated: magic, version, kind, tensor count, meta length and total length are checked on the
48-byte header alone; dtype, ndim, shape, ``prod(shape) * itemsize == byte length``, per-tensor
bytes and the exact total are checked on the descriptors before the body is allocated. Malformed
input raises :class:`WireError` (a ``ValueError``), never another exception and never a hang.

Ownership. :func:`encode` returns buffers that alias the message's tensors when they are CPU and
contiguous (no copy); the caller must not modify those tensors until the buffers are consumed.
CUDA (or other device) tensors are copied to CPU for sending, and non-contiguous ones are made
contiguous. :func:`decode` and :class:`~lamina.transport.stream.StreamDecoder` return CPU tensors that are views of one
uint8 buffer holding the whole message: with :class:`StreamDecoder` that buffer is freshly
allocated and owned by the message; with :func:`decode` it is the caller's buffer when writable
(zero copy; do not reuse the buffer while the tensors live, or pass ``copy=True``), and a private
copy when the buffer is read-only (``bytes``).

This module defines the layout for all of Python (:data:`HEADER_FORMAT`, :data:`DESC_FORMAT`,
:data:`DTYPE_CODES`, :data:`LIMIT_FIELDS`, ...); the C++ ring fast path keeps its own copy,
which :func:`lamina.transport.shm_fast.load` checks against these at every load.
"""
from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass, field
from enum import IntEnum
from types import MappingProxyType
from typing import Any, Mapping, Union

import numpy as np
import torch

__all__ = ["MAGIC", "VERSION", "ALIGN", "MAX_NDIM", "HEADER_FORMAT", "DESC_FORMAT", "HEADER_SIZE",
           "DESC_SIZE", "DTYPE_CODES", "SUPPORTED_DTYPES", "LIMIT_FIELDS", "WireError", "MsgKind",
           "WireLimits", "DEFAULT_LIMITS", "Message", "Header", "TensorDesc", "encode",
           "encode_bytes", "encode_meta", "check_message", "unpack_header", "unpack_preamble",
           "decode_kind", "decode_meta", "assemble", "decode"]

MAGIC = b"LMNA"
VERSION = 1
ALIGN = 64  # tensor data offsets are multiples of this (from the message start)
MAX_NDIM = 8  # fixed by the descriptor layout

Buffer = Union[bytes, bytearray, memoryview, np.ndarray]


class WireError(ValueError):
    """Malformed, unsupported or over-limit message (on encode or decode)."""


class MsgKind(IntEnum):
    """Message kinds (u16 on the wire; values 20..65535 are free for new kinds)."""

    PREPARE = 1
    ATTEND = 2
    RESULT = 3
    FREE = 4
    EXPORT = 5
    IMPORT = 6
    KV = 7
    STATS = 8
    OK = 9
    ERROR = 10
    SHUTDOWN = 11
    PING = 12
    STEP = 13  # engine -> compute replica: one StepPlan with its routes (lamina.transport.step_codec)
    TOKENS = 14  # compute replica -> engine: the step's sampled token ids
    CONTEXT = 15  # compute replica -> next replica: a micro-batch's context (staggered pipelining)
    OPEN = 16  # engine -> node/replica: open a channel for a peer; OK carries its endpoint
    CONNECT = 17  # engine -> compute replica: attach the endpoints of its nodes and next replica
    RESET = 18  # engine -> compute replica: drop every micro-batch in flight (after an error)
    CANCEL = 19  # engine -> memory node: roll back steps dropped in flight (after a role died)
    SHARE = 20  # engine -> memory node: a shard shares other shards' slots (prefix caching)
    MAILBOX = 21  # compute replica -> memory node: serve its step mailbox (lamina.transport.mailbox)


_DTYPE_CODES: dict[torch.dtype, int] = {
    torch.float32: 1, torch.float16: 2, torch.bfloat16: 3, torch.int64: 4, torch.int32: 5,
    torch.uint8: 6, torch.bool: 7, torch.float64: 8, torch.int16: 9, torch.int8: 10,
}
DTYPE_CODES: Mapping[torch.dtype, int] = MappingProxyType(_DTYPE_CODES)  # dtype -> wire code
_CODE_DTYPES = {code: dt for dt, code in _DTYPE_CODES.items()}
SUPPORTED_DTYPES: tuple[torch.dtype, ...] = tuple(_DTYPE_CODES)
_ITEMSIZE = {dt: torch.empty((), dtype=dt).element_size() for dt in _DTYPE_CODES}

HEADER_FORMAT = "<4sHHqqqIIQ"  # the header's struct format (fields: see the module docstring)
DESC_FORMAT = "<BB6xQ8q"  # one tensor descriptor's struct format
_HEADER = struct.Struct(HEADER_FORMAT)
_DESC = struct.Struct(DESC_FORMAT)
HEADER_SIZE = _HEADER.size  # 48
DESC_SIZE = _DESC.size  # 80
LIMIT_FIELDS = ("max_tensors", "max_ndim", "max_tensor_bytes", "max_message_bytes",
                "max_meta_bytes")  # WireLimits' fields, in the order of WireLimits.as_tuple


@dataclass(frozen=True)
class WireLimits:
    """Upper bounds a receiver enforces before reading or allocating (and a sender before sending)."""

    max_tensors: int = 64
    max_ndim: int = MAX_NDIM
    max_tensor_bytes: int = 4 << 30
    max_message_bytes: int = 8 << 30
    max_meta_bytes: int = 4 << 20

    def __post_init__(self) -> None:
        if not 0 <= self.max_ndim <= MAX_NDIM:
            raise ValueError(f"max_ndim must be in [0, {MAX_NDIM}], got {self.max_ndim}")
        for name in ("max_tensors", "max_tensor_bytes", "max_message_bytes", "max_meta_bytes"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")

    def as_tuple(self) -> tuple[int, ...]:
        """(max_tensors, max_ndim, max_tensor_bytes, max_message_bytes, max_meta_bytes), the
        order of :data:`LIMIT_FIELDS`: the form the C++ ring fast path takes."""
        return tuple(getattr(self, name) for name in LIMIT_FIELDS)


DEFAULT_LIMITS = WireLimits()


@dataclass
class Message:
    """One protocol message. ``meta`` must be JSON-serialisable with string keys (it arrives as
    what ``json.loads`` gives back: tuples become lists). ``tensors`` may be of any
    :data:`SUPPORTED_DTYPES`, any shape up to ``MAX_NDIM`` dims (0-d and empty included)."""

    kind: MsgKind
    step_id: int = 0
    layer: int = 0
    reply_to: int = 0
    meta: dict[str, Any] = field(default_factory=dict)
    tensors: list[torch.Tensor] = field(default_factory=list)


@dataclass(frozen=True)
class Header:
    """The fixed header, already validated against the limits."""

    kind: MsgKind
    step_id: int
    layer: int
    reply_to: int
    num_tensors: int
    meta_len: int
    total_len: int

    @property
    def preamble_len(self) -> int:
        """Bytes of descriptors + meta that follow the header."""
        return self.num_tensors * DESC_SIZE + self.meta_len


@dataclass(frozen=True)
class TensorDesc:
    """One tensor's descriptor: where its bytes lie in the message and how to view them."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    nbytes: int
    offset: int


def _align(n: int) -> int:
    return n + (-n % ALIGN)


# ------------------------------------------------------------------------------------- encode


def encode_meta(meta: Any, limits: WireLimits) -> bytes:
    """``meta`` as the wire's JSON bytes (``b""`` for an empty dict); :class:`WireError` when it
    is not a JSON-serialisable dict with string keys or is over ``limits.max_meta_bytes``."""
    if not isinstance(meta, dict):
        raise WireError(f"meta must be a dict, got {type(meta).__name__}")
    if not meta:
        return b""
    if any(not isinstance(k, str) for k in meta):
        raise WireError("meta keys must be strings")
    try:
        data = json.dumps(meta, separators=(",", ":"), allow_nan=False).encode()
    except (TypeError, ValueError, RecursionError) as exc:
        raise WireError(f"meta is not JSON-serialisable: {exc}") from None
    if len(data) > limits.max_meta_bytes:
        raise WireError(f"meta is {len(data)} bytes, limit {limits.max_meta_bytes}")
    return data


def _plan(msg: Message, limits: WireLimits) -> tuple[MsgKind, bytes, list[TensorDesc], int]:
    """Validate ``msg`` against ``limits`` without touching tensor data."""
    try:
        kind = MsgKind(msg.kind)
    except ValueError:
        raise WireError(f"unknown message kind {msg.kind!r}") from None
    meta = encode_meta(msg.meta, limits)
    if len(msg.tensors) > limits.max_tensors:
        raise WireError(f"{len(msg.tensors)} tensors, limit {limits.max_tensors}")
    off = _align(HEADER_SIZE + len(msg.tensors) * DESC_SIZE + len(meta))
    descs = []
    for i, t in enumerate(msg.tensors):
        if not isinstance(t, torch.Tensor):
            raise WireError(f"tensor {i} is a {type(t).__name__}, not a torch.Tensor")
        if t.dtype not in _DTYPE_CODES:
            raise WireError(f"tensor {i}: unsupported dtype {t.dtype}")
        if t.dim() > limits.max_ndim:
            raise WireError(f"tensor {i}: {t.dim()} dims, limit {limits.max_ndim}")
        nbytes = t.numel() * t.element_size()
        if nbytes > limits.max_tensor_bytes:
            raise WireError(f"tensor {i}: {nbytes} bytes, limit {limits.max_tensor_bytes}")
        descs.append(TensorDesc(t.dtype, tuple(t.shape), nbytes, off))
        off += _align(nbytes)
    if off > limits.max_message_bytes:
        raise WireError(f"message is {off} bytes, limit {limits.max_message_bytes}")
    return kind, meta, descs, off


def check_message(msg: Message, limits: WireLimits = DEFAULT_LIMITS) -> dict[str, Any]:
    """Check that ``msg`` would encode under ``limits`` (raises :class:`WireError`); returns a
    fresh copy of its meta as it would arrive (a JSON round trip). Tensor data is not touched."""
    _, meta, _, _ = _plan(msg, limits)
    return json.loads(meta) if meta else {}


def _raw(t: torch.Tensor) -> np.ndarray:
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()  # device tensors are staged through host memory (synchronous copy)
    t = t.resolve_conj().resolve_neg().contiguous()
    return t.reshape(-1).view(torch.uint8).numpy()


def encode(msg: Message, limits: WireLimits = DEFAULT_LIMITS) -> list[Buffer]:
    """Encode ``msg`` as a list of buffer-protocol objects whose concatenation is the message.

    The first buffer holds header, descriptors, meta and padding; then each tensor's bytes
    (aliasing the tensor when it is CPU-contiguous) and its padding. Raises :class:`WireError`
    when the message breaks ``limits`` or holds unsupported data."""
    kind, meta, descs, total = _plan(msg, limits)
    try:
        head = bytearray(_HEADER.pack(MAGIC, VERSION, int(kind), msg.step_id, msg.layer,
                                      msg.reply_to, len(descs), len(meta), total))
        for d in descs:
            shape = d.shape + (0,) * (MAX_NDIM - len(d.shape))
            head += _DESC.pack(_DTYPE_CODES[d.dtype], len(d.shape), d.nbytes, *shape)
    except struct.error as exc:
        raise WireError(f"header field out of range: {exc}") from None
    head += meta
    head += bytes(-len(head) % ALIGN)
    out: list[Buffer] = [bytes(head)]
    for t, d in zip(msg.tensors, descs):
        if d.nbytes:
            out.append(_raw(t))
            if d.nbytes % ALIGN:
                out.append(bytes(-d.nbytes % ALIGN))
    return out


def encode_bytes(msg: Message, limits: WireLimits = DEFAULT_LIMITS) -> bytes:
    """:func:`encode` joined into one ``bytes`` (one copy of everything)."""
    return b"".join(memoryview(b).cast("B") for b in encode(msg, limits))


# ------------------------------------------------------------------------------------- decode


def unpack_header(data: Buffer, limits: WireLimits = DEFAULT_LIMITS) -> Header:
    """Parse and validate the first :data:`HEADER_SIZE` bytes of ``data``."""
    if len(memoryview(data).cast("B")) < HEADER_SIZE:
        raise WireError(f"truncated header: need {HEADER_SIZE} bytes")
    magic, version, kind, step_id, layer, reply_to, n, meta_len, total = \
        _HEADER.unpack_from(data, 0)
    if magic != MAGIC:
        raise WireError(f"bad magic {magic!r}, expected {MAGIC!r}")
    if version != VERSION:
        raise WireError(f"unsupported wire version {version} (this side speaks {VERSION})")
    kind = decode_kind(kind)
    if n > limits.max_tensors:
        raise WireError(f"{n} tensors stated, limit {limits.max_tensors}")
    if meta_len > limits.max_meta_bytes:
        raise WireError(f"meta of {meta_len} bytes stated, limit {limits.max_meta_bytes}")
    if total > limits.max_message_bytes:
        raise WireError(f"message of {total} bytes stated, limit {limits.max_message_bytes}")
    if total < _align(HEADER_SIZE + n * DESC_SIZE + meta_len):
        raise WireError(f"stated total {total} bytes is shorter than its own header")
    return Header(kind, step_id, layer, reply_to, n, meta_len, total)


def unpack_preamble(header: Header, data: Buffer, limits: WireLimits = DEFAULT_LIMITS
                    ) -> tuple[list[TensorDesc], dict[str, Any]]:
    """Parse the ``header.preamble_len`` bytes after the header: descriptors and meta. Checks
    every descriptor and that they add up to exactly ``header.total_len``."""
    data = memoryview(data).cast("B")
    if len(data) != header.preamble_len:
        raise WireError(f"preamble is {len(data)} bytes, expected {header.preamble_len}")
    off = _align(HEADER_SIZE + header.preamble_len)
    descs = []
    for i in range(header.num_tensors):
        code, ndim, nbytes, *dims = _DESC.unpack_from(data, i * DESC_SIZE)
        dtype = _CODE_DTYPES.get(code)
        if dtype is None:
            raise WireError(f"tensor {i}: unknown dtype code {code}")
        if ndim > limits.max_ndim:
            raise WireError(f"tensor {i}: {ndim} dims, limit {limits.max_ndim}")
        shape = tuple(dims[:ndim])
        if any(d < 0 for d in shape) or any(dims[ndim:]):
            raise WireError(f"tensor {i}: bad shape {tuple(dims)} for ndim {ndim}")
        if nbytes > limits.max_tensor_bytes:
            raise WireError(f"tensor {i}: {nbytes} bytes stated, limit {limits.max_tensor_bytes}")
        if math.prod(shape) * _ITEMSIZE[dtype] != nbytes:
            raise WireError(f"tensor {i}: shape {shape} of {dtype} is "
                            f"{math.prod(shape) * _ITEMSIZE[dtype]} bytes, stated {nbytes}")
        descs.append(TensorDesc(dtype, shape, nbytes, off))
        off += _align(nbytes)
    if off != header.total_len:
        raise WireError(f"stated total {header.total_len} bytes, descriptors add up to {off}")
    return descs, decode_meta(bytes(data[header.num_tensors * DESC_SIZE:]))


def decode_kind(kind: int) -> MsgKind:
    """The :class:`MsgKind` of a header's kind field; :class:`WireError` when unknown."""
    try:
        return _KIND_OF[kind]  # a dict lookup: MsgKind(kind) costs ~0.6 us per message
    except (KeyError, TypeError):
        raise WireError(f"unknown message kind {kind}") from None


_KIND_OF: dict[int, MsgKind] = {int(k): k for k in MsgKind}


def decode_meta(data: bytes) -> dict[str, Any]:
    """A message's meta from its JSON bytes (``b""``: ``{}``); :class:`WireError` when they are
    not UTF-8 JSON holding an object."""
    if not data:
        return {}
    try:
        meta = json.loads(data.decode("utf-8"))
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError, JSONDecodeError
        raise WireError(f"meta is not valid JSON: {exc}") from None
    if not isinstance(meta, dict):
        raise WireError(f"meta must be a JSON object, got {type(meta).__name__}")
    return meta


def assemble(header: Header, descs: list[TensorDesc], meta: dict[str, Any],
             body: torch.Tensor) -> Message:
    """Build the Message whose tensors are views of ``body`` (uint8, the whole message)."""
    tensors = [body[d.offset:d.offset + d.nbytes].view(d.dtype).view(d.shape) for d in descs]
    return Message(header.kind, header.step_id, header.layer, header.reply_to, meta, tensors)


def decode(buffer: Buffer | torch.Tensor, limits: WireLimits = DEFAULT_LIMITS, *,
           copy: bool = False) -> Message:
    """Decode one whole message from ``buffer`` (exactly one message, no trailing bytes).

    ``buffer`` may be bytes-like or a 1-D CPU uint8 tensor. Tensors of the result are views of
    ``buffer`` when it is writable and ``copy`` is false; otherwise of a private copy."""
    if isinstance(buffer, torch.Tensor):
        if buffer.dtype != torch.uint8 or buffer.dim() != 1 or buffer.device.type != "cpu" \
                or not buffer.is_contiguous():
            raise WireError("a tensor buffer must be a contiguous 1-D CPU uint8 tensor")
        view = memoryview(buffer.numpy())
    else:
        view = memoryview(buffer).cast("B")
    header = unpack_header(view, limits)
    if len(view) != header.total_len:
        raise WireError(f"buffer holds {len(view)} bytes, header states {header.total_len}")
    descs, meta = unpack_preamble(header, view[HEADER_SIZE:HEADER_SIZE + header.preamble_len],
                                  limits)
    if isinstance(buffer, torch.Tensor):
        body = buffer.clone() if copy else buffer
    elif copy or view.readonly:
        body = torch.frombuffer(bytearray(view), dtype=torch.uint8)
    else:
        body = torch.frombuffer(view, dtype=torch.uint8)
    return assemble(header, descs, meta, body)
