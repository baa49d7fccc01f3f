"""Plain PyTorch modules (no transformers code) for the splitter's SDPA fallback path.

Convention: ``forward(input_ids[1,T], position_ids[1,T]) -> [1,T,vocab]``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    def __init__(self, d: int, heads: int, kv_heads: int, mask: bool = False, causal: bool = True):
        super().__init__()
        self.h, self.kv, self.dh = heads, kv_heads, d // heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.q = nn.Linear(d, d)
        self.kvp = nn.Linear(d, 2 * kv_heads * self.dh)
        self.o = nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.mask, self.causal = mask, causal

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        T = x.shape[1]
        h = self.ln1(x)
        q = self.q(h).view(1, T, self.h, self.dh).transpose(1, 2)
        k, v = self.kvp(h).view(1, T, 2, self.kv, self.dh).permute(2, 0, 3, 1, 4)
        if self.mask:
            m = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
            a = F.scaled_dot_product_attention(q, k, v, attn_mask=m, enable_gqa=True)
        else:
            a = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal, enable_gqa=True)
        x = x + self.o(a.transpose(1, 2).reshape(1, T, -1))
        return x + self.mlp(self.ln2(x))


class TinySDPALM(nn.Module):
    def __init__(self, vocab: int = 64, d: int = 32, heads: int = 4, kv_heads: int = 2,
                 layers: int = 2, **block_kw):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(128, d)
        self.blocks = nn.ModuleList(Block(d, heads, kv_heads, **block_kw) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        x = self.tok(input_ids) + self.pos(position_ids)
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln(x))


class NoAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.e = nn.Embedding(64, 16)
        self.f = nn.Linear(16, 64)

    def forward(self, input_ids, position_ids):
        return self.f(self.e(input_ids))


def make_sdpa_lm() -> nn.Module:
    torch.manual_seed(0)
    return TinySDPALM().eval()
