"""Shared test data for the transport tests: raw messages built with ``struct`` from the
layout documented in lamina/transport/wire.py (independent of its code), and exact tensor
comparison."""
from __future__ import annotations

import struct

import torch


def bits(t: torch.Tensor) -> torch.Tensor:
    """Bit pattern of ``t`` (so NaNs and -0.0 compare exactly)."""
    if t.dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
        return t.contiguous().view({4: torch.int32, 8: torch.int64, 2: torch.int16}[t.element_size()])
    return t


def assert_same(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert y.dtype == x.dtype and y.shape == x.shape and y.device.type == "cpu"
        assert torch.equal(bits(x.cpu()), bits(y))



# Raw messages built from the documented layout with struct (independent of wire.py).
HDR = struct.Struct("<4sHHqqqIIQ")
DESC = struct.Struct("<BB6xQ8q")


def _align(n: int) -> int:
    return (n + 63) // 64 * 64


def raw_message(*, magic=b"LMNA", version=1, kind=12, descs=(), meta=b"", num_tensors=None,
                meta_len=None, total=None) -> bytes:
    """Header + descriptors + meta (no tensor data). ``descs``: (dtype code, ndim, nbytes, dims)."""
    pre = b"".join(DESC.pack(code, ndim, nbytes, *(list(dims) + [0] * (8 - len(dims))))
                   for code, ndim, nbytes, dims in descs) + meta
    if total is None:
        total = _align(48 + len(pre)) + sum(_align(d[2]) for d in descs)
    n = len(descs) if num_tensors is None else num_tensors
    return HDR.pack(magic, version, kind, 0, 0, 0, n, len(meta) if meta_len is None else meta_len,
                    total) + pre


MALFORMED = {
    "bad_magic": raw_message(magic=b"XXXX"),
    "bad_version": raw_message(version=2),
    "unknown_kind": raw_message(kind=999),
    "unknown_dtype": raw_message(descs=[(200, 1, 16, (4,))]),
    "too_many_tensors": raw_message(num_tensors=100_000),
    "too_many_dims": raw_message(descs=[(6, 9, 1, (1,) * 8)]),
    "negative_dims": raw_message(descs=[(1, 2, 16, (-1, -4))]),
    "shape_bytes_mismatch": raw_message(descs=[(1, 1, 20, (4,))]),
    "total_mismatch": raw_message(descs=[(1, 1, 16, (4,))], total=_align(48 + 80) + 128),
    "message_over_limit": raw_message(total=1 << 62),
    "tensor_over_limit": raw_message(descs=[(6, 1, 5 << 30, (5 << 30,))]),  # limit 4 GiB
    "meta_over_limit": raw_message(meta_len=5 << 20),
    "meta_not_json": raw_message(meta=b"{nope"),
    "meta_not_object": raw_message(meta=b"[1, 2]"),
}

# what each rejection's message names (so the intended check fired, not a later one)
MALFORMED_MATCH = {
    "bad_magic": "magic", "bad_version": "version", "unknown_kind": "kind",
    "unknown_dtype": "dtype", "too_many_tensors": "tensors stated", "too_many_dims": "dims",
    "negative_dims": "bad shape", "shape_bytes_mismatch": "stated 20", "total_mismatch": "add up",
    "message_over_limit": "message of", "tensor_over_limit": "bytes stated, limit",
    "meta_over_limit": "meta of", "meta_not_json": "JSON", "meta_not_object": "JSON object",
}
