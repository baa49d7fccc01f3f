"""The C++ CPU kernel (``lamina.kernels.cpp_ext``) against the reference, and its fallback."""
from __future__ import annotations

import warnings
from dataclasses import replace

import pytest
import torch

from kernel_cases import assert_matches, make_spec, random_case
from lamina.kernels import cpp_ext, paged_attention, paged_attention_ref
from lamina.kernels.kv_format import kv_format

pytestmark = pytest.mark.skipif(not cpp_ext.available(),
                                reason=f"C++ kernel not built: {cpp_ext.build_error()}")

HEADS = [(4, 4), (9, 3), (16, 2), (4, 1)]  # MHA, SmolLM2's GQA 3, GQA 8, MQA
MASKS = [(None, None), (24, None), (None, 30.0), (40, 2.5)]  # (window, softcap)
F32_ATOL = 1e-5


def _check(case, dtype, threads=None):
    ref_o, ref_lse = paged_attention_ref(*case.args())
    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        o, lse = cpp_ext.paged_attention_cpp(*case.args())
    finally:
        torch.set_num_threads(before)
    assert_matches(o, lse, ref_o, ref_lse, dtype)
    seen = ~torch.isneginf(ref_lse)
    if dtype == torch.float32 and seen.any():
        assert (o - ref_o).abs().max().item() <= F32_ATOL
        assert (lse[seen] - ref_lse[seen]).abs().max().item() <= F32_ATOL
    return o, lse


@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"h{h[0]}kv{h[1]}")
@pytest.mark.parametrize("mask", MASKS, ids=lambda m: f"w{m[0]}-cap{m[1]}")
@pytest.mark.parametrize("head_dim", [64, 128, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_cpp_matches_reference(heads, mask, head_dim, dtype):
    """Ragged contexts, shuffled slots (unused ones NaN), decode and extend, empty shards,
    int32 or int64 indices (by seed)."""
    seed = 11 * HEADS.index(heads) + 3 * MASKS.index(mask) + head_dim
    case = random_case(seed, num_heads=heads[0], num_kv_heads=heads[1], head_dim=head_dim,
                       dtype=dtype, num_requests=(1, 10), max_ctx=400, max_q=20,
                       window=mask[0], softcap=mask[1])
    _check(case, dtype)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_cpp_smollm_decode_and_long_context_splits(threads, dtype):
    """SmolLM2 shapes; a few long requests (fewer items than threads: split along the keys
    and merged) and many short ones."""
    for seed, reqs, ctx in ((1, (1, 2), 3000), (2, (24, 40), 300)):
        case = random_case(seed, num_heads=9, num_kv_heads=3, head_dim=64, dtype=dtype,
                           num_requests=reqs, max_ctx=ctx, decode_only=True)
        _check(case, dtype, threads)


def test_cpp_prefill_chunk_over_a_long_context():
    case = random_case(5, num_heads=9, num_kv_heads=3, head_dim=64, num_requests=(2, 3),
                       max_ctx=1500, max_q=200)
    _check(case, torch.float32)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("pools", ["float32", "bfloat16", "int8", "fp8_e4m3", "k16v8"])
def test_cpp_many_query_vectors_per_kv_head(pools, threads):
    """Items with many query vectors per KV head run the tile kernels (attention_tile.h):
    a cascade's group (every row sees the whole prefix), long prefill chunks (several tiles,
    ragged tails, causal and windowed masks, splits along the keys), MHA and head_dim 128."""
    fmt = kv_format(pools)
    cases = [
        random_case(31, num_heads=9, num_kv_heads=3, head_dim=64, num_requests=(1, 1),
                    max_ctx=700, max_q=2, decode_only=True, allow_empty=False),
        random_case(32, num_heads=9, num_kv_heads=3, head_dim=64, num_requests=(2, 3),
                    max_ctx=900, max_q=150, allow_empty=False),
        random_case(33, num_heads=4, num_kv_heads=4, head_dim=128, num_requests=(1, 3),
                    max_ctx=400, max_q=110, window=70),
        random_case(34, num_heads=16, num_kv_heads=2, head_dim=16, num_requests=(1, 4),
                    max_ctx=300, max_q=40),
    ]
    group = cases[0]  # 64 rows of one request, all past its keys: a cascade's prefix call
    n = int(group.kv_indptr[-1])
    cases[0] = replace(group, q=torch.randn(64, 9, 64), qo_indptr=torch.tensor([0, 64]),
                       q_positions=torch.full((64,), n + 5), kv_start_pos=torch.tensor([0]))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for case in cases:
            (kq, ks), (vq, vs) = fmt.k.quantize(case.k_pool), fmt.v.quantize(case.v_pool)
            args = (case.q, fmt.k.view(kq), fmt.v.view(vq), *case.args()[3:])
            scales = {"k_scale": ks, "v_scale": vs}
            ref_o, ref_lse = paged_attention_ref(*args, **scales)
            o, lse = cpp_ext.paged_attention_cpp(*args, **scales)
            assert_matches(o, lse, ref_o, ref_lse, torch.float32)
            seen = ~torch.isneginf(ref_lse)
            assert (o - ref_o).abs().max().item() <= 2e-5
            assert (lse[seen] - ref_lse[seen]).abs().max().item() <= 2e-5
    finally:
        torch.set_num_threads(before)


def test_cpp_bfloat16_queries_on_a_float32_pool():
    case = random_case(6, num_heads=9, num_kv_heads=3, head_dim=64)
    q = case.q.to(torch.bfloat16)
    ref_o, ref_lse = paged_attention_ref(*replace(case, q=q).args())
    o, lse = cpp_ext.paged_attention_cpp(*replace(case, q=q).args())
    assert o.dtype == torch.bfloat16
    assert_matches(o, lse, ref_o, ref_lse, torch.bfloat16)


def test_cpp_degenerate_inputs():
    spec = make_spec(4, 2, 16)
    pool = torch.randn(8, 2, 16)
    none = torch.zeros(0, dtype=torch.long)
    o, lse = cpp_ext.paged_attention_cpp(torch.zeros(0, 4, 16), pool, pool, torch.tensor([0]),
                                         torch.tensor([0]), none, none, none, spec)
    assert o.shape == (0, 4, 16) and lse.shape == (0, 4)
    q = torch.randn(2, 4, 16)
    o, lse = cpp_ext.paged_attention_cpp(q, pool, pool, torch.tensor([0, 1, 2]),
                                         torch.tensor([0, 2, 4]), torch.tensor([5, 1, 6, 2]),
                                         torch.tensor([3, 4]), torch.tensor([10, 20]), spec)
    assert torch.all(o == 0) and torch.isneginf(lse).all()  # shards after the queries
    with pytest.raises(ValueError, match="do not match spec"):
        cpp_ext.paged_attention_cpp(q, pool, pool, torch.tensor([0, 1, 2]),
                                    torch.tensor([0, 0, 0]), none, torch.tensor([3, 4]),
                                    torch.tensor([0, 0]), make_spec(4, 4, 16))


def test_cpp_slots_outside_the_pool_raise():
    case = random_case(52, num_heads=4, num_kv_heads=2, head_dim=16, num_requests=(3, 6),
                       decode_only=True, allow_empty=False)
    bad = case.kv_indices.clone()
    bad[-1] = case.k_pool.shape[0]
    with pytest.raises((IndexError, RuntimeError), match="outside the pool"):
        cpp_ext.paged_attention_cpp(*replace(case, kv_indices=bad).args())


def test_auto_dispatch_on_cpu_uses_the_cpp_kernel(monkeypatch, kernels):
    import lamina.kernels.dispatch as dispatch
    kernels("auto")
    assert dispatch.backend_for(torch.device("cpu")) == "cpp"
    kernels("torch")
    assert dispatch.backend_for(torch.device("cpu")) == "torch"
    kernels("cpp")
    case = random_case(8, num_heads=9, num_kv_heads=3, head_dim=64)
    ref_o, ref_lse = paged_attention_ref(*case.args())
    assert_matches(*paged_attention(*case.args()), ref_o, ref_lse, torch.float32)


def test_a_failed_build_warns_once_and_dispatch_falls_back(monkeypatch, kernels):
    import lamina.kernels.dispatch as dispatch
    bogus = ("-DLAMINA_BREAK_THE_BUILD", "-include", "/nonexistent/lamina_no_such_header.h")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert cpp_ext.load(extra=bogus) is None
        assert cpp_ext.load(extra=bogus) is None  # tried once per process
    assert len([w for w in caught if issubclass(w.category, RuntimeWarning)]) == 1
    assert "could not be built" in str(caught[0].message)
    monkeypatch.setenv("LAMINA_CPP_CFLAGS", " ".join(bogus))
    kernels("auto")
    case = random_case(9, num_heads=6, num_kv_heads=2, head_dim=16)
    ref_o, ref_lse = paged_attention_ref(*case.args())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert dispatch.backend_for(torch.device("cpu")) == "torch"
        for _ in range(2):
            assert_matches(*paged_attention(*case.args()), ref_o, ref_lse, torch.float32)
    assert not caught  # the one warning of this process was given above
    assert cpp_ext.build_error()


def test_merge_states_on_cpu_never_builds_the_extension(monkeypatch, kernels):
    import lamina.kernels.dispatch as dispatch
    calls = []
    monkeypatch.setattr(cpp_ext, "load", lambda *a, **k: calls.append(1))
    kernels("auto")
    os_, lses = torch.randn(2, 3, 4, 8), torch.randn(2, 3, 4)
    o, lse = dispatch.merge_states(os_, lses)
    assert torch.allclose(lse, torch.logsumexp(lses, 0)) and not calls


@pytest.mark.slow
@pytest.mark.parametrize("flags,path", [
    (("-mno-avx512f",), "avx2"),                         # what an AVX2-only CPU runs
    (("-mno-avx512f", "-mno-avx2", "-mno-fma"), "generic"),  # the plain loops
], ids=["avx2", "generic"])
def test_narrower_simd_paths(flags, path):
    """The paths of CPUs narrower than this one: each builds a variant (~40 s the first time,
    cached after) and must match the reference (attention) and float64 (linear)."""
    if path == "avx2" and cpp_ext.load().simd_features().split()[0] == "generic":
        pytest.skip("this CPU has no AVX2 + FMA (the native build is the plain loops)")
    ext = cpp_ext.load(extra=flags)
    assert ext is not None and ext.simd_features().split()[0] == path
    for seed, dtype in ((21, torch.float32), (22, torch.bfloat16)):
        case = random_case(seed, num_heads=9, num_kv_heads=3, head_dim=64, dtype=dtype,
                           num_requests=(3, 8), max_q=12, window=50 if seed == 22 else None,
                           softcap=20.0 if seed == 22 else None)  # 21: the tile kernels too
        spec = case.spec
        o, lse = ext.paged_attention(*case.args()[:8], float(spec.scale),
                                     int(spec.window or 0), float(spec.softcap or 0.0))
        ref_o, ref_lse = paged_attention_ref(*case.args())
        assert_matches(o, lse, ref_o, ref_lse, dtype)
    for seed, name in ((23, "int8"), (24, "fp8_e4m3"), (25, "k16v8")):  # 8-bit KV formats
        case = random_case(seed, num_heads=9, num_kv_heads=3, head_dim=64, num_requests=(3, 8),
                           max_q=12)
        fmt = kv_format(name)
        (kq, ks), (vq, vs) = fmt.k.quantize(case.k_pool), fmt.v.quantize(case.v_pool)
        args = (case.q, fmt.k.view(kq), fmt.v.view(vq), *case.args()[3:8])
        o, lse = ext.paged_attention(*args, float(case.spec.scale), 0, 0.0, ks, vs)
        ref_o, ref_lse = paged_attention_ref(*args, case.spec, k_scale=ks, v_scale=vs)
        assert_matches(o, lse, ref_o, ref_lse, torch.float32)
        data, scale = torch.zeros_like(vq), torch.zeros_like(vs)
        slots = torch.arange(vq.shape[0])
        ext.kv_store(fmt.v.view(data), scale, slots, case.v_pool.nan_to_num())
        want, want_scale = fmt.v.quantize(case.v_pool.nan_to_num())
        assert torch.equal(data, want) and torch.equal(scale, want_scale)
    g = torch.Generator().manual_seed(5)
    x, w = torch.randn(7, 96, generator=g), torch.randn(70, 96, generator=g)
    y = ext.skinny_linear(x, ext.pack_linear_weight(w), 70, None)
    assert torch.allclose(y.double(), x.double() @ w.double().T, atol=1e-4)
    blocks = torch.randint(0, 256, (70, 96 // 32 * 20), dtype=torch.uint8, generator=g)
    blocks[:, 0::20], blocks[:, 1::20] = 0, 0x20  # Q4_1 scales d = 2^-7 ...
    blocks[:, 2::20], blocks[:, 3::20] = 0, 0xA0  # ... and minimums m = -2^-7
    q4_k = torch.randint(0, 256, (70, 144), dtype=torch.uint8, generator=g)  # one super-block
    q4_k[:, 1], q4_k[:, 3] = 0x20, 0x20  # d = dmin = 2^-7 (low bytes random)
    native = cpp_ext.load()  # integer dot products (VNNI / maddubs / plain loops) agree
    for kind, blocks, x in ((3, blocks, x), (12, q4_k, torch.randn(5, 256, generator=g))):
        y = ext.quant_linear_q8(x, ext.pack_q8_weight(blocks, kind), 70, kind, None)
        want = native.quant_linear_q8(x, native.pack_q8_weight(blocks, kind), 70, kind, None)
        assert torch.allclose(y, want, rtol=1e-5, atol=1e-6)


def test_a_lock_left_by_a_dead_builder_does_not_hang_loads():
    """torch leaves its ``lock`` file behind when a build is killed; a later process must
    still load the extension (not wait for the lock forever)."""
    import subprocess
    import sys
    key = cpp_ext.build_key(cpp_ext.CFLAGS + cpp_ext.extra_cflags(), cpp_ext._compiler())
    stale = cpp_ext.cache_root() / key / "lock"
    stale.touch()
    out = subprocess.run([sys.executable, "-c", "from lamina.kernels import cpp_ext; "
                          "print(cpp_ext.load() is not None)"],
                         capture_output=True, text=True, timeout=300)
    assert out.stdout.strip() == "True", out.stderr[-2000:]
    assert not stale.exists()


def test_every_included_header_is_in_the_build_key():
    """A header's edit must change the build key, or a stale build would be loaded."""
    import re
    names = {h.name for h in cpp_ext.HEADERS}
    for src in cpp_ext.SOURCES + cpp_ext.HEADERS:
        for inc in re.findall(r'#include "([^"]+)"', src.read_text()):
            assert inc in names, f"{src.name} includes {inc}, which the build key does not cover"


def test_a_built_extension_loads_without_a_build_step(monkeypatch):
    """Once built, an extension is imported from its library: torch's build (ninja, compiler
    checks: ~0.5 s a process) is not run again."""
    from torch.utils import cpp_extension

    from lamina.build import Extension
    assert cpp_ext.load() is not None  # built
    monkeypatch.setattr(cpp_extension, "load", lambda **kw: pytest.fail("built again"))
    ext = cpp_ext.EXTENSION
    fresh = Extension(ext.name, ext.sources, ext.headers)
    assert fresh.load() is cpp_ext.load()


def test_read_kv_rows_reads_exactly_the_indexed_rows():
    """The kernel bench's read ceiling folds every indexed K and V row (max), and only those."""
    ext = cpp_ext.load()
    g = torch.Generator().manual_seed(3)
    k, v = torch.randn(64, 3, 64, generator=g), torch.randn(64, 3, 64, generator=g)
    idx = torch.randperm(64, generator=g)[:20]
    k[idx[0]] += 100.0  # an indexed row holds the max of K
    v[(set(range(64)) - set(idx.tolist())).pop()] += 1000.0  # an unread row must not count
    want = k[idx].max().item() + v[idx].max().item()
    assert ext.read_kv_rows(k, v, idx) == pytest.approx(want)
    assert ext.read_kv_rows(k, v, idx.int()) == pytest.approx(want)
    with pytest.raises(IndexError):
        ext.read_kv_rows(k, v, torch.tensor([64]))
