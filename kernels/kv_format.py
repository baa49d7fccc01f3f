"""KV formats: how a memory node's pool stores K and V, and the torch reference of each.

A format names a storage for keys and one for values (``KV_DTYPES`` in :mod:`lamina.types`):

========== ===================== ===================== ==================================
name       K                     V                     bytes per token, head (D = 64)
========== ===================== ===================== ==================================
float32    float32               float32               512
bfloat16   bfloat16              bfloat16              256
int8       int8 + scale          int8 + scale          136
fp8_e4m3   float8 e4m3 + scale   float8 e4m3 + scale   136
k16v8      bfloat16              int8 + scale          196
========== ===================== ===================== ==================================

``auto`` is the model's dtype. An 8-bit part keeps one float32 scale per token and KV head,
written when the token is appended (symmetric, absmax): ``scale = amax(|x|) / qmax`` over the
head's ``D`` values, ``x ~ q * scale``; ``qmax`` is 127 for int8 and 448 (e4m3's largest) for
fp8. A pool stores an 8-bit part as ``data[..., D]`` (int8, or the fp8 bits as uint8: torch
cannot index-copy float8 on CPU) beside ``scale[...]`` float32; :meth:`KVPart.view` gives the
data in its dtype (``torch.float8_e4m3fn`` for fp8) for the kernels.

The quantiser below is the oracle of the C++ one (``kv_store`` in
``kernels/csrc/paged_attention_cpu.cpp``), which gives the same bytes: float32 arithmetic in
this order, ``inv = qmax / amax``, ``q = round_half_even(x * inv)`` (int8) or
``float8(clamp(x * inv, -448, 448))`` (fp8, round to nearest even), ``scale = amax / qmax``;
an all-zero head gets ``q = 0, scale = 0``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from lamina.types import KV_DTYPES

__all__ = ["KVPart", "KVFormat", "kv_format", "FLOAT_DTYPES"]

FLOAT_DTYPES = (torch.float32, torch.bfloat16)  # unscaled parts a pool may hold


@dataclass(frozen=True)
class KVPart:
    """The storage of K or of V: ``dtype`` as the kernels see it (float32, bfloat16, int8 or
    float8_e4m3fn), ``storage`` as the pool holds it (uint8 for fp8)."""

    dtype: torch.dtype

    @property
    def scaled(self) -> bool:
        """Whether a float32 scale per token and head goes with the data."""
        return self.dtype not in FLOAT_DTYPES

    @property
    def qmax(self) -> float:
        return 127.0 if self.dtype == torch.int8 else 448.0

    @property
    def storage(self) -> torch.dtype:
        return torch.uint8 if self.dtype == torch.float8_e4m3fn else self.dtype

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.storage).element_size()

    def view(self, data: torch.Tensor) -> torch.Tensor:
        """Pool storage ``data`` seen in :attr:`dtype` (no copy)."""
        return data.view(self.dtype) if data.dtype != self.dtype else data

    def quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``x[..., D]`` (any float dtype) as ``(data[..., D] in storage, scale[...] float32)``;
        scale None for an unscaled part (then data is ``x`` cast)."""
        if not self.scaled:
            return x.to(self.dtype), None
        x = x.float()
        amax = x.abs().amax(dim=-1)
        live = amax > 0
        qmax = torch.full_like(amax, self.qmax)  # a true division (a scalar / tensor is not)
        inv = torch.where(live, qmax / torch.where(live, amax, 1.0), 0.0)
        y = x * inv[..., None]
        if self.dtype == torch.int8:
            data = torch.round(y).clamp_(-127, 127).to(torch.int8)
        else:
            data = y.clamp_(-448.0, 448.0).to(torch.float8_e4m3fn).view(torch.uint8)
        return data, amax / qmax

    def dequantize(self, data: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
        """float32 values of pool ``data[..., D]`` (storage or :attr:`dtype`) and its scales."""
        x = self.view(data).float()
        return x if scale is None else x * scale[..., None]


@dataclass(frozen=True)
class KVFormat:
    """A pool's KV format: ``name`` (one of ``KV_DTYPES`` but ``auto``), K's part, V's part."""

    name: str
    k: KVPart
    v: KVPart

    @property
    def scaled(self) -> bool:
        return self.k.scaled or self.v.scaled

    def bytes_per_token_head(self, head_dim: int) -> int:
        """Bytes of K plus V (with scales) one token takes per KV head, per layer."""
        return sum(p.itemsize * head_dim + (4 if p.scaled else 0) for p in (self.k, self.v))


_PARTS = {"float32": (torch.float32, torch.float32), "bfloat16": (torch.bfloat16, torch.bfloat16),
          "int8": (torch.int8, torch.int8), "fp8_e4m3": (torch.float8_e4m3fn, torch.float8_e4m3fn),
          "k16v8": (torch.bfloat16, torch.int8)}


def kv_format(name: str | torch.dtype | KVFormat, model_dtype: torch.dtype = torch.float32
              ) -> KVFormat:
    """The format ``name`` names (``auto``: ``model_dtype``'s); a torch dtype names the plain
    float format. Raises ValueError for an unknown name or a model dtype no pool holds."""
    if isinstance(name, KVFormat):
        return name
    if isinstance(name, torch.dtype):
        model_dtype, name = name, "auto"
    if name == "auto":
        if model_dtype not in FLOAT_DTYPES:
            raise ValueError(f"kv_dtype auto: pools hold float32 or bfloat16, not the model's "
                             f"{model_dtype}; name a kv_dtype")
        name = str(model_dtype).removeprefix("torch.")
    if name not in _PARTS:
        raise ValueError(f"kv_dtype {name!r}: expected one of {', '.join(KV_DTYPES)}")
    k, v = _PARTS[name]
    return KVFormat(name, KVPart(k), KVPart(v))
