"""Random paged-attention batches and tolerances shared by the kernel tests.

A :class:`PagedCase` is one call's arguments: R requests with ragged KV lengths whose slots are a
shuffled subset of a larger pool (unused slots hold NaN, so an implementation that reads outside
its request's slots fails loudly), decode or extend queries at chosen absolute positions.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass, replace

import torch

from lamina.types import AttentionSpec

# (o atol, o rtol, lse atol) per input dtype, against the float32 reference.
TOLERANCES = {
    torch.float32: (1e-4, 1e-4, 1e-4),
    torch.float16: (3e-3, 3e-3, 1e-3),
    torch.bfloat16: (2e-2, 2e-2, 2e-3),
}


@dataclass
class PagedCase:
    q: torch.Tensor
    k_pool: torch.Tensor
    v_pool: torch.Tensor
    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    q_positions: torch.Tensor
    kv_start_pos: torch.Tensor
    spec: AttentionSpec

    def args(self) -> tuple:
        return (self.q, self.k_pool, self.v_pool, self.qo_indptr, self.kv_indptr,
                self.kv_indices, self.q_positions, self.kv_start_pos, self.spec)

    def to(self, device: str | torch.device) -> "PagedCase":
        moved = {f: getattr(self, f).to(device) for f in
                 ("q", "k_pool", "v_pool", "qo_indptr", "kv_indptr", "kv_indices",
                  "q_positions", "kv_start_pos")}
        return replace(self, **moved)


def make_spec(num_heads: int, num_kv_heads: int, head_dim: int, window: int | None = None,
              softcap: float | None = None) -> AttentionSpec:
    return AttentionSpec(layer=0, num_heads=num_heads, num_kv_heads=num_kv_heads,
                         head_dim=head_dim, scale=1.0 / math.sqrt(head_dim), window=window,
                         softcap=softcap)


def _query_positions(rng: random.Random, start: int, kv_len: int, q_len: int) -> list[int]:
    """Absolute positions of q_len queries relative to a shard [start, start+kv_len)."""
    mode = rng.choices(["tail", "beyond", "before", "inside"], weights=[6, 2, 1, 2])[0]
    if mode == "tail" and q_len <= kv_len:  # the usual case: new tokens end the shard
        return list(range(start + kv_len - q_len, start + kv_len))
    if mode == "before" and start >= q_len:  # shard lies in the future: sees nothing
        return list(range(start - q_len, start))
    if mode == "inside":  # arbitrary sorted positions around the shard
        lo, hi = max(0, start - 3), start + kv_len + 3
        return sorted(rng.sample(range(lo, hi), min(q_len, hi - lo)))[:q_len] + \
            [hi + i for i in range(max(0, q_len - (hi - lo)))]
    gap = rng.randint(0, 5)  # "beyond": the tail lives on another node
    return list(range(start + kv_len + gap, start + kv_len + gap + q_len))


def random_case(seed: int, *, num_heads: int, num_kv_heads: int, head_dim: int = 16,
                dtype: torch.dtype = torch.float32, num_requests: tuple[int, int] = (1, 6),
                max_ctx: int = 300, max_q: int = 8, window: int | None = None,
                softcap: float | None = None, decode_only: bool = False,
                allow_empty: bool = True) -> PagedCase:
    """A random ragged, paged batch (CPU tensors), fully determined by ``seed``."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    spec = make_spec(num_heads, num_kv_heads, head_dim, window, softcap)
    R = rng.randint(*num_requests)
    kv_lens, q_lens, starts, positions = [], [], [], []
    for _ in range(R):
        kv_len = rng.randint(1, max_ctx)
        if allow_empty and rng.random() < 0.08:
            kv_len = 0
        q_len = 1 if decode_only or rng.random() < 0.5 else rng.randint(2, max_q)
        if allow_empty and rng.random() < 0.05:
            q_len = 0
        start = rng.choice([0, 0, rng.randint(1, 64)])
        kv_lens.append(kv_len)
        q_lens.append(q_len)
        starts.append(start)
        positions += _query_positions(rng, start, kv_len, q_len)
    N, T = sum(kv_lens), sum(q_lens)
    S = N + rng.randint(1, N // 2 + 8)
    perm = torch.randperm(S, generator=gen)
    idx_dtype = rng.choice([torch.int32, torch.int64])
    k_pool = torch.randn(S, num_kv_heads, head_dim, generator=gen)
    v_pool = torch.randn(S, num_kv_heads, head_dim, generator=gen)
    k_pool[perm[N:]] = float("nan")
    v_pool[perm[N:]] = float("nan")

    def indptr(lens: list[int]) -> torch.Tensor:
        return torch.tensor([0] + lens, dtype=idx_dtype).cumsum(0).to(idx_dtype)

    return PagedCase(
        q=torch.randn(T, num_heads, head_dim, generator=gen).to(dtype),
        k_pool=k_pool.to(dtype), v_pool=v_pool.to(dtype),
        qo_indptr=indptr(q_lens), kv_indptr=indptr(kv_lens),
        kv_indices=perm[:N].to(idx_dtype),
        q_positions=torch.tensor(positions, dtype=idx_dtype).reshape(T),
        kv_start_pos=torch.tensor(starts, dtype=idx_dtype).reshape(R), spec=spec)


def assert_matches(o: torch.Tensor, lse: torch.Tensor, ref_o: torch.Tensor, ref_lse: torch.Tensor,
                   dtype: torch.dtype) -> None:
    """Compare an implementation's ``(o, lse)`` with the reference's under dtype tolerances;
    rows the reference leaves unseen (``lse = -inf``) must be exactly ``o = 0, lse = -inf``."""
    atol, rtol, lse_atol = TOLERANCES[dtype]
    assert o.dtype == ref_o.dtype and o.shape == ref_o.shape
    assert lse.dtype == torch.float32 and lse.shape == ref_lse.shape
    unseen = torch.isneginf(ref_lse)
    assert torch.equal(torch.isneginf(lse), unseen), "rows that see no key differ"
    assert torch.all(o[unseen] == 0), "a row that sees no key must have o = 0"
    torch.testing.assert_close(lse[~unseen], ref_lse[~unseen], atol=lse_atol, rtol=0)
    torch.testing.assert_close(o.float(), ref_o.float(), atol=atol, rtol=rtol)
