"""Plain reference attention with a per-request KV cache, used by ``SplitModel.verify()``.

Deliberately simple (one request at a time, full masks): it is the yardstick the split model is
held to, independent of the kernels and the memory nodes.
"""
from __future__ import annotations

import torch

from lamina.types import AttentionSpec


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
                        spec: AttentionSpec) -> torch.Tensor:
    """``q[t,H,D]`` over the cached and new ``k/v[n,Hkv,D*]`` at positions ``0..n-1``;
    ``q_pos[t]`` are absolute query positions. Returns ``o[t,H,Dv]`` in q's dtype."""
    g = q.shape[1] // k.shape[1]
    kk = k.repeat_interleave(g, dim=1).double()
    vv = v.repeat_interleave(g, dim=1).double()
    s = torch.einsum("thd,nhd->htn", q.double(), kk) * spec.scale
    if spec.softcap:
        s = spec.softcap * torch.tanh(s / spec.softcap)
    k_pos = torch.arange(k.shape[0], device=q.device)
    visible = k_pos[None, :] <= q_pos[:, None]
    if spec.window is not None:
        visible &= (q_pos[:, None] - k_pos[None, :]) < spec.window
    p = torch.softmax(s.masked_fill(~visible[None], float("-inf")), dim=-1)
    return torch.einsum("htn,nhd->thd", p, vv).to(q.dtype)


class ReferenceKV:
    """Contiguous K/V per (request, layer); ``attend`` appends a segment's k/v then attends."""

    def __init__(self) -> None:
        self.k: dict[tuple[int, int], torch.Tensor] = {}
        self.v: dict[tuple[int, int], torch.Tensor] = {}

    def attend(self, req: int, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               q_pos: torch.Tensor, spec: AttentionSpec) -> torch.Tensor:
        key = (req, layer)
        if key in self.k:
            if self.k[key].shape[0] != int(q_pos[0]):
                raise ValueError(f"request {req}: cached {self.k[key].shape[0]} tokens but new "
                                 f"tokens start at position {int(q_pos[0])}")
            self.k[key] = torch.cat([self.k[key], k])
            self.v[key] = torch.cat([self.v[key], v])
        else:
            self.k[key], self.v[key] = k, v
        return reference_attention(q, self.k[key], self.v[key], q_pos, spec)
