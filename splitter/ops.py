"""The opaque attention operator that marks every cut point of a split model.

``torch.ops.lamina.attention(q[T,H,D], k[T,Hkv,D], v[T,Hkv,Dv], scale, window, softcap) -> o[T,H,Dv]``
is a ``torch.library`` custom op with a fake kernel, so ``torch.export`` keeps each attention as
one node carrying its parameters. Its eager kernel is plain causal attention over one sequence
at positions ``0..T-1`` (only used when an exported graph is run whole); the split model never
runs it: the runtime computes attention on memory nodes instead.

``register_hf_attention()`` registers the ``"lamina"`` implementation with transformers'
``AttentionInterface``; models loaded with ``attn_implementation="lamina"`` (or switched with
``model.set_attn_implementation("lamina")``) call the op over flattened tokens (batch size 1).
"""
from __future__ import annotations

import math

import torch

OP_NAME = "lamina::attention"


@torch.library.custom_op(OP_NAME, mutates_args=())
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
              window: int | None, softcap: float | None) -> torch.Tensor:
    T, H, _ = q.shape
    g = H // k.shape[1]
    kk = k.repeat_interleave(g, dim=1).float()
    vv = v.repeat_interleave(g, dim=1).float()
    s = torch.einsum("thd,nhd->htn", q.float(), kk) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    pos = torch.arange(T, device=q.device)
    visible = pos[None, :] <= pos[:, None]
    if window is not None:
        visible &= (pos[:, None] - pos[None, :]) < window
    p = torch.softmax(s.masked_fill(~visible, float("-inf")), dim=-1)
    return torch.einsum("htn,nhd->thd", p, vv).to(q.dtype)


@attention.register_fake
def _(q, k, v, scale, window, softcap):
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError("lamina.attention expects q[T,H,D], k[T,Hkv,D], v[T,Hkv,Dv]")
    return q.new_empty(q.shape[0], q.shape[1], v.shape[2])


ATTENTION_OP = torch.ops.lamina.attention.default


def _hf_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                  value: torch.Tensor, attention_mask: torch.Tensor | None,
                  scaling: float | None = None, dropout: float = 0.0,
                  sliding_window: int | None = None, softcap: float | None = None,
                  **kwargs) -> tuple[torch.Tensor, None]:
    """transformers attention function: ``query[1,H,T,D]`` etc. -> ``([1,T,H,Dv], None)``."""
    if not getattr(module, "is_causal", True):
        raise ValueError(f"{type(module).__name__}: lamina splits causal self-attention only "
                         "(this module is not causal)")
    if query.shape[0] != 1:
        raise ValueError(f"{type(module).__name__}: lamina attention runs over flattened tokens "
                         f"(batch size 1), got batch {query.shape[0]}")
    if scaling is None:
        scaling = 1.0 / math.sqrt(query.shape[-1])
    q = query[0].transpose(0, 1)
    k = key[0].transpose(0, 1)
    v = value[0].transpose(0, 1)
    o = torch.ops.lamina.attention(q, k, v, float(scaling),
                                   int(sliding_window) if sliding_window else None,
                                   float(softcap) if softcap else None)
    return o.unsqueeze(0), None


def register_hf_attention() -> str:
    """Register the ``lamina`` attention implementation with transformers; returns its name."""
    from transformers import AttentionInterface

    AttentionInterface.register("lamina", _hf_attention)
    return "lamina"
