"""The torch reference against independent oracles on contiguous caches.

Oracles: ``torch.nn.functional.scaled_dot_product_attention`` with an explicit boolean mask (no
softcap), and plain float64 math (softcap, and the log-sum-exp that SDPA does not return).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernel_cases import make_spec
from lamina.kernels import paged_attention_ref


def _mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """visible[t, n] built independently: j <= i and (i - j < window)."""
    rows = []
    for i in q_pos.tolist():
        rows.append([j <= i and (window is None or i - j < window) for j in k_pos.tolist()])
    return torch.tensor(rows, dtype=torch.bool).reshape(len(rows), k_pos.numel())


def _plain_math(q, k, v, visible, spec):
    """float64 softmax attention with optional softcap: (o[t,H,D], lse[t,H])."""
    g = spec.num_heads // spec.num_kv_heads
    k64 = k.double().repeat_interleave(g, dim=1)
    v64 = v.double().repeat_interleave(g, dim=1)
    s = torch.einsum("thd,nhd->htn", q.double(), k64) * spec.scale
    if spec.softcap:
        s = spec.softcap * torch.tanh(s / spec.softcap)
    s = s.masked_fill(~visible[None], float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.softmax(s, -1).nan_to_num(0.0)
    return torch.einsum("htn,nhd->thd", p, v64), lse.transpose(0, 1)


def _sdpa(q, k, v, visible, spec):
    """SDPA on one request: q[t,H,D], k/v[n,Hkv,D] -> o[t,H,D] (float64)."""
    g = spec.num_heads // spec.num_kv_heads
    qh = q.double().transpose(0, 1)[None]
    kh = k.double().repeat_interleave(g, dim=1).transpose(0, 1)[None]
    vh = v.double().repeat_interleave(g, dim=1).transpose(0, 1)[None]
    o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=visible, scale=spec.scale)
    return o[0].transpose(0, 1)


CASES = [  # (num_heads, num_kv_heads, q positions relative to shard end, window, softcap)
    (4, 4, "decode", None, None), (6, 2, "decode", None, None), (8, 1, "decode", None, None),
    (4, 4, "extend", None, None), (6, 2, "extend", 5, None), (8, 1, "extend", None, None),
    (6, 2, "decode", 7, None), (4, 2, "extend", None, 2.0), (6, 3, "decode", None, 1.5),
    (8, 2, "extend", 9, 3.0), (6, 2, "beyond", 11, None), (4, 1, "extend", 1, None),
]


@pytest.mark.parametrize("num_heads,num_kv_heads,mode,window,softcap", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_matches_independent_oracle(num_heads, num_kv_heads, mode, window, softcap,
                                              dtype):
    torch.manual_seed(CASES.index((num_heads, num_kv_heads, mode, window, softcap)))
    D = 32
    spec = make_spec(num_heads, num_kv_heads, D, window, softcap)
    lens, starts = [37, 1, 90], [0, 5, 12]  # three requests in one contiguous cache
    q_lens = [1, 1, 1] if mode == "decode" else ([1, 1, 6] if mode == "extend" else [3, 2, 4])
    k = torch.randn(sum(lens), num_kv_heads, D).to(dtype)
    v = torch.randn(sum(lens), num_kv_heads, D).to(dtype)
    q = torch.randn(sum(q_lens), num_heads, D).to(dtype)
    q_pos = []
    for n, s, t in zip(lens, starts, q_lens):
        first = s + n - t if mode != "beyond" else s + n + 2
        q_pos += list(range(max(first, s), max(first, s) + t))
    kv_indptr = torch.tensor([0, 37, 38, 128])
    qo_indptr = torch.tensor([0] + q_lens).cumsum(0)
    o, lse = paged_attention_ref(q, k, v, qo_indptr, kv_indptr, torch.arange(128),
                                 torch.tensor(q_pos), torch.tensor(starts), spec)
    atol = 2e-5 if dtype == torch.float32 else 1e-2
    for r in range(3):
        qs, qe, ks, ke = qo_indptr[r], qo_indptr[r + 1], kv_indptr[r], kv_indptr[r + 1]
        k_pos = torch.arange(starts[r], starts[r] + int(ke - ks))
        visible = _mask(torch.tensor(q_pos[qs:qe]), k_pos, window)
        assert visible.any(1).all()  # every query here sees a key
        exp_o, exp_lse = _plain_math(q[qs:qe], k[ks:ke], v[ks:ke], visible, spec)
        torch.testing.assert_close(lse[qs:qe].double(), exp_lse, atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(o[qs:qe].double(), exp_o, atol=atol, rtol=atol)
        if not softcap:
            sdpa_o = _sdpa(q[qs:qe], k[ks:ke], v[ks:ke], visible, spec)
            torch.testing.assert_close(o[qs:qe].double(), sdpa_o, atol=atol, rtol=atol)


def test_reference_query_that_sees_nothing():
    """Queries before the shard, a query outside the window, an empty shard: o = 0, lse = -inf."""
    spec = make_spec(2, 1, 16, window=4)
    k = torch.randn(20, 1, 16)
    q = torch.randn(4, 2, 16)
    # request 0: shard at positions 10..19, queries at 3 (before) and 30 (window passed it)
    # request 1: empty shard, query at 5
    o, lse = paged_attention_ref(q[:3], k, k, torch.tensor([0, 2, 3]), torch.tensor([0, 10, 10]),
                                 torch.arange(10), torch.tensor([3, 30, 5]),
                                 torch.tensor([10, 0]), spec)
    assert torch.isneginf(lse).all()
    assert torch.all(o == 0)
