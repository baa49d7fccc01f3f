"""fuse_small_ops: a slice's small-op chains as one C++ call each, equal to the chain up to
float rounding (float32) or bitwise (other dtypes, which run the chain's own ops)."""
import os
import sys

import pytest
import torch
import torch.nn.functional as F

from lamina.computenode.fused_ops import CHAINS, FOLDS, fuse_small_ops
from lamina.kernels import cpp_ext

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "splitter"))
from tiny_models import ARCHS, tiny_model  # noqa: E402

pytestmark = pytest.mark.skipif(not cpp_ext.available(), reason="C++ extension unavailable")
G = torch.Generator().manual_seed(0)


def rms_chain(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean([-1], True) + eps))


def rope_chain(x, pos, inv_freq, scale):
    f = pos.unsqueeze(2).to(torch.float32) * inv_freq
    e = torch.cat([f, f], -1)
    c, s = (e.cos() * scale).unsqueeze(1), (e.sin() * scale).unsqueeze(1)
    h = x.shape[-1] // 2
    return x * c + torch.cat([-x[..., h:], x[..., :h]], -1) * s


@pytest.mark.parametrize("rows,dim", [(1, 576), (7, 64), (3, 37), (0, 16)])
def test_rms_norm_matches_the_chain(rows, dim):
    x, w = 3 * torch.randn(rows, dim, generator=G), torch.randn(dim, generator=G)
    got = cpp_ext.load().rms_norm(x, w, 1e-5)
    assert got.shape == x.shape and got.dtype == x.dtype
    torch.testing.assert_close(got, rms_chain(x, w, 1e-5), rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("n", [1536, 13, 0])
def test_silu_mul_matches_the_chain(n):
    a = 6 * torch.randn(2, n, generator=G)
    a[0, :3] = torch.tensor([-100.0, 100.0, 0.0])[:min(3, n)] if n else a[0, :0]
    b = torch.randn(2, n, generator=G)
    torch.testing.assert_close(cpp_ext.load().silu_mul(a, b), F.silu(a) * b,
                               rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("tokens,heads,dim,scale", [(1, 9, 64, 1.0), (5, 3, 16, 0.5),
                                                    (4, 2, 8, 1.0)])
def test_rope_matches_the_chain_on_a_strided_view(tokens, heads, dim, scale):
    x = torch.randn(1, tokens, heads, dim, generator=G).transpose(1, 2)  # what a slice passes
    pos = torch.randint(0, 4000, (1, tokens), generator=G)
    inv = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
    got = cpp_ext.load().rope(x, pos, inv, scale, dim // 2)
    assert got.shape == x.shape
    assert got.transpose(1, 2).is_contiguous()  # [B, T, H, D] in memory: q/k[T, H, D] views
    torch.testing.assert_close(got, rope_chain(x, pos, inv, scale), rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("shape", [(1, 1, 576), (1, 5, 32), (3, 7), (0, 16)])
def test_add_rms_norm_is_the_add_then_the_norm_bitwise(shape):
    ext = cpp_ext.load()
    a, b = torch.randn(shape, generator=G), torch.randn(shape, generator=G)
    w = torch.randn(shape[-1], generator=G)
    total, normed = ext.add_rms_norm(a, b, w, 1e-5)
    assert torch.equal(total, a + b) and torch.equal(normed, ext.rms_norm(a + b, w, 1e-5))
    # broadcasting or another dtype: the chain's own ops
    total, normed = ext.add_rms_norm(a, b[..., :1], w, 1e-5)
    assert torch.equal(total, a + b[..., :1])
    assert torch.equal(normed, ext.rms_norm(a + b[..., :1], w, 1e-5))


@pytest.mark.parametrize("tokens,heads,dim", [(1, 9, 64), (5, 3, 16)])
def test_heads_is_the_view_chain_bitwise(tokens, heads, dim):
    ext = cpp_ext.load()
    x = torch.randn(1, tokens, heads * dim, generator=G)
    pos = torch.randint(0, 4000, (1, tokens), generator=G)
    inv = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
    sizes = [1, tokens, -1, dim]
    turned = ext.rope(x.view(sizes).transpose(1, 2), pos, inv, 0.5, dim // 2)
    got = ext.heads(x, sizes, pos, inv, 0.5, dim // 2)
    want = turned.select(0, 0).transpose(0, 1)
    assert torch.equal(got, want) and got.stride() == want.stride()
    got = ext.heads(x, sizes, None, None, 1.0, 0)
    want = x.view(sizes).transpose(1, 2).select(0, 0).transpose(0, 1)
    assert torch.equal(got, want) and got.data_ptr() == x.data_ptr()  # a view, as the chain's
    with pytest.raises(RuntimeError, match="both or neither"):
        ext.heads(x, sizes, pos, None, 1.0, 0)


def test_other_dtypes_run_the_chain_bitwise():
    ext = cpp_ext.load()
    x = torch.randn(3, 16, generator=G).bfloat16()
    w = torch.randn(16, generator=G).bfloat16()
    assert torch.equal(ext.rms_norm(x, w, 1e-6), rms_chain(x, w, 1e-6))
    assert torch.equal(ext.silu_mul(x, w.expand(3, 16)), F.silu(x) * w)
    q = torch.randn(1, 2, 3, 8, generator=G).bfloat16()
    pos, inv = torch.arange(3)[None], torch.rand(4, generator=G)
    assert torch.equal(ext.rope(q, pos, inv, 1.0, 4), rope_chain(q, pos, inv, 1.0))
    # a split other than D/2 is the chain's own business: computed as written, not as the kernel
    x = torch.randn(1, 2, 3, 8, generator=G)
    f = pos.unsqueeze(2).to(torch.float32) * inv
    e = torch.cat([f, f], -1)
    want = x * e.cos().unsqueeze(1) + torch.cat([-x[..., 3:], x[..., :3]], -1) * e.sin().unsqueeze(1)
    assert torch.equal(ext.rope(x, pos, inv, 1.0, 3), want)


def attend(k, q, key, v):  # any fixed function of q, k, v: the same in both runs
    return (q * key.repeat_interleave(q.shape[1] // key.shape[1], 1)).tanh()


@pytest.mark.parametrize("arch", ARCHS)
def test_fused_split_model_computes_the_same(arch):
    from lamina.splitter import split_model
    sm = split_model(tiny_model(arch))
    ids, pos, rows = torch.tensor([5, 9, 33, 2, 7]), torch.arange(3, 8), torch.tensor([4])
    before = sm.forward(ids, pos, rows, attend)
    calls = sum(1 for gm in sm.slices for n in gm.graph.nodes if n.op == "call_function")
    counts = dict.fromkeys((*CHAINS, *FOLDS), 0)
    for gm in sm.slices:
        for name, n in fuse_small_ops(gm, cpp_ext.load()).items():
            counts[name] += n
    after = sm.forward(ids, pos, rows, attend)
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-6)
    fewer = calls - sum(1 for gm in sm.slices for n in gm.graph.nodes if n.op == "call_function")
    layers = 2  # tiny_config
    if arch in ("llama", "qwen2", "mistral", "phi3"):  # RMSNorm, SwiGLU, rotate-half RoPE
        # every norm but the first reads a residual add; q, k and v of every layer as heads
        # (phi3's fused projection: q and k slice it before they turn, v alone is folded)
        heads = layers if arch == "phi3" else 3 * layers
        assert counts == {"rms_norm": 2 * layers + 1, "silu_mul": layers, "rope": 2 * layers,
                          "add_rms_norm": 2 * layers, "heads": heads}
        assert fewer >= 25 * layers
    elif arch in ("gpt2", "opt"):  # LayerNorm, GELU/ReLU, no rotary: the heads alone
        assert counts == {**dict.fromkeys((*CHAINS, *FOLDS), 0), "heads": 3 * layers}
        assert fewer == 9 * layers  # view, transpose, select, transpose -> heads


def test_replica_fuses_its_cpu_slices():
    from lamina.computenode.replica import ComputeReplica
    from lamina.splitter import split_model
    replica = ComputeReplica(split_model(tiny_model("llama")), "cpu")
    targets = {n.target for gm in replica.split.slices for n in gm.graph.nodes
               if n.op == "call_function"}
    ext = cpp_ext.load()
    assert {ext.rms_norm, ext.silu_mul, ext.add_rms_norm, ext.heads} <= targets
