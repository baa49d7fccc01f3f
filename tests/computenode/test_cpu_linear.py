"""skinny_linear == F.linear; use_skinny_linear rewrites exported linear nodes."""
import os
import sys

import pytest
import torch
import torch.nn.functional as F

from lamina.computenode.cpu_linear import SKINNY_ROWS, skinny_linear, use_skinny_linear

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "splitter"))
from tiny_models import tiny_model  # noqa: E402


@pytest.mark.parametrize("shape", [(1, 32), (8, 32), (1, 5, 32), (SKINNY_ROWS, 32),
                                   (SKINNY_ROWS + 1, 32), (0, 32)])
@pytest.mark.parametrize("bias", [False, True])
def test_skinny_linear_matches_linear(shape, bias):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, generator=g)
    w = torch.randn(48, 32, generator=g)
    b = torch.randn(48, generator=g) if bias else None
    got = skinny_linear(x, w, b)
    assert got.shape == (*shape[:-1], 48)
    torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-5, atol=1e-5)


def test_bfloat16_without_panels_takes_the_plain_path():
    x, w = torch.randn(4, 16).bfloat16(), torch.randn(8, 16).bfloat16()
    assert torch.equal(skinny_linear(x, w), F.linear(x, w))


def test_rewrite_keeps_split_outputs():
    from lamina.splitter import split_model
    sm = split_model(tiny_model("llama"))
    ids = torch.tensor([[5, 9, 33, 2]])
    pos = torch.arange(4)[None]
    before = [sm.run_slice(0, {"input_ids": ids, "position_ids": pos})]
    n = sum(use_skinny_linear(gm) for gm in sm.slices)
    assert n > 0
    assert not any(node.target is torch.ops.aten.linear.default
                   for gm in sm.slices for node in gm.graph.nodes)
    after = sm.run_slice(0, {"input_ids": ids, "position_ids": pos})
    for k, v in before[0].items():
        torch.testing.assert_close(after[k], v, rtol=1e-5, atol=1e-5)


def test_packed_weights_take_the_cpp_kernel(monkeypatch):
    from lamina.computenode import cpu_linear
    from lamina.splitter import split_model
    if not cpu_linear.packing_available():
        pytest.skip("C++ kernels not built")
    sm = split_model(tiny_model("llama"))
    ids, pos = torch.tensor([[5, 9, 33, 2]]), torch.arange(4)[None]
    before = sm.run_slice(0, {"input_ids": ids, "position_ids": pos})
    assert sum(use_skinny_linear(gm) for gm in sm.slices) > 0
    packed = [name for gm in sm.slices for name, _ in gm.named_buffers()
              if name.startswith("_lamina_panels_")]
    assert packed
    ext = cpu_linear.cpp_ext.load()
    targets = [n.target for gm in sm.slices for n in gm.graph.nodes if n.op == "call_function"]
    assert ext.packed_linear in targets and torch.ops.aten.linear.default not in targets
    after = sm.run_slice(0, {"input_ids": ids, "position_ids": pos})
    for k, v in before.items():
        torch.testing.assert_close(after[k], v, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 5, SKINNY_ROWS, SKINNY_ROWS + 1])
def test_packed_linear_takes_the_kernel_up_to_its_row_limit(rows):
    """ext.packed_linear (what a packed node calls): the packed kernel up to max_rows rows (the
    result equals skinny_linear's bit for bit), F.linear beyond (bit for bit too)."""
    from lamina.computenode import cpu_linear
    if not cpu_linear.packing_available():
        pytest.skip("C++ kernels not built")
    ext = cpu_linear.cpp_ext.load()
    g = torch.Generator().manual_seed(rows)
    w, b = torch.randn(40, 32, generator=g), torch.randn(40, generator=g)
    x = torch.randn(1, rows, 32, generator=g)
    p = ext.pack_linear_weight(w)
    got = ext.packed_linear(x, w, b, p, SKINNY_ROWS, 16)
    assert got.shape == (1, rows, 40)
    want = (ext.skinny_linear(x.reshape(rows, 32), p, 40, b).view(1, rows, 40)
            if rows <= SKINNY_ROWS else F.linear(x, w, b))
    assert torch.equal(got, want)
    torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    # a float64 x is nobody's packed case: F.linear's error, not a wrong answer
    with pytest.raises(RuntimeError):
        ext.packed_linear(x.double(), w, b, p, SKINNY_ROWS, 16)


def test_bfloat16_slices_pack_in_their_layout_and_row_limit():
    """A bfloat16 model's weights are packed in the bfloat16 layout (AMX pairs where the kernel
    has them), each in its own place in the arena, and the row limit follows the layout."""
    from lamina.computenode import cpu_linear
    from lamina.splitter import split_model
    if not cpu_linear.packing_available():
        pytest.skip("C++ kernels not built")
    model = tiny_model("llama").to(torch.bfloat16)
    sm = split_model(model)
    ids, pos = torch.tensor([[5, 9, 33, 2]]), torch.arange(4)[None]
    before = sm.run_slice(0, {"input_ids": ids, "position_ids": pos})
    assert sum(use_skinny_linear(gm) for gm in sm.slices) > 0
    ext = cpu_linear.cpp_ext.load()
    amx = cpu_linear.amx_layout(ext)
    assert cpu_linear._bf16_rows == (cpu_linear.BF16_PACKED_ROWS_AMX if amx
                                     else cpu_linear.BF16_PACKED_ROWS)
    panels = [b for gm in sm.slices for name, b in gm.named_buffers()
              if name.startswith("_lamina_panels_")]
    assert panels and all(p.dtype == torch.bfloat16 and p.shape[-1] == (2 if amx else p.shape[-1])
                          for p in panels)
    spans = sorted((p.data_ptr(), p.data_ptr() + p.nbytes) for p in panels)
    assert all(end <= nxt for (_, end), (nxt, _) in zip(spans, spans[1:]))  # no overlap
    after = sm.run_slice(0, {"input_ids": ids, "position_ids": pos})
    for k, v in before.items():  # bfloat16 rounding (AMX also rounds x to bfloat16)
        torch.testing.assert_close(after[k].float(), v.float(), rtol=5e-2, atol=5e-2)


def test_torch_kernels_pack_nothing(monkeypatch, kernels):
    from lamina.computenode import cpu_linear
    from lamina.splitter import split_model
    kernels("torch")
    assert not cpu_linear.packing_available()
    sm = split_model(tiny_model("llama"))
    assert sum(use_skinny_linear(gm) for gm in sm.slices) > 0
    assert not any(name.startswith("_lamina_panels_")
                   for gm in sm.slices for name, _ in gm.named_buffers())


def test_bfloat16_weights_pack_and_round_like_linear():
    from lamina.computenode import cpu_linear
    from lamina.kernels import cpp_ext
    if not cpu_linear.packing_available():
        pytest.skip("C++ kernels not built")
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 64, generator=g).bfloat16()
    w = torch.randn(40, 64, generator=g).bfloat16()
    b = torch.randn(40, generator=g).bfloat16()
    got = skinny_linear(x, w, b, cpp_ext.load().pack_linear_weight(w))
    want = F.linear(x.double(), w.double(), b.double())
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), want, rtol=1e-2, atol=1e-2)  # bf16 rounding


def test_no_packing_when_memory_is_short(monkeypatch):
    from lamina.computenode import cpu_linear
    from lamina.splitter import split_model
    if not cpu_linear.packing_available():
        pytest.skip("C++ kernels not built")
    monkeypatch.setattr(cpu_linear, "free_memory", lambda: 1024)
    sm = split_model(tiny_model("llama"))
    assert sum(use_skinny_linear(gm) for gm in sm.slices) > 0
    assert not any(name.startswith("_lamina_panels_")
                   for gm in sm.slices for name, _ in gm.named_buffers())


def test_free_memory_reads_the_host():
    from lamina.computenode.cpu_linear import free_memory
    assert 0 < free_memory() < 1 << 62


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,k", [(64, 96), (70, 96), (5, 40), (49, 576), (1, 8), (33, 12)])
def test_packing_in_place_writes_the_cpp_layout(dtype, n, k):
    """The arena is filled in place (no temporary pack): byte for byte what
    ``pack_linear_weight`` returns, padding included, or the C++ pack where K does not split."""
    from lamina.computenode.cpu_linear import pack_into
    from lamina.kernels import cpp_ext
    ext = cpp_ext.load()
    if ext is None:
        pytest.skip("the C++ extension does not build here")
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(n * k)).to(dtype)
    want = ext.pack_linear_weight(w)
    got = torch.zeros_like(want)
    if pack_into(w, got):
        assert torch.equal(got, want)
    else:
        assert k % want.shape[-1]  # only a K that is not a multiple of the lanes is refused
        assert torch.equal(got, torch.zeros_like(want))  # nothing written
    assert pack_into(w.t().contiguous().t(), torch.zeros_like(want)) == (k % want.shape[-1] == 0)
