"""The slices' linear layers on CPU for decode-sized batches.

A decode micro-batch has a few rows per linear layer, so every step streams all the weights
and BLAS libraries, tuned for larger problems, run far below both memory bandwidth and FMA
peak. Two paths, best first:

* **Packed C++ kernel** (``kernels/csrc/skinny_linear_cpu.cpp``): :func:`use_skinny_linear`
  packs each constant weight once into panels (``ext.pack_linear_weight``; the layout depends
  on the instruction set) and the node calls ``ext.skinny_linear``, which keeps a block of
  outputs in registers (12 x 32 with AVX-512; with AVX2, 2 rows x 6 weight rows of 8-lane
  partial sums) and reads each weight once per call (``bench/linear.py`` compares it with
  ``F.linear`` and a sequential read of the same bytes). Float32 and bfloat16
  weights (bfloat16 panels are half the bytes: run by AMX tiles where the CPU has AMX-BF16 and
  the OS grants the tile state, else widened in registers). Used when the C++
  extension is available and the ``linear`` kernel choice is ``auto`` or ``packed``
  (:class:`lamina.config.KernelConfig`); the packed copy
  doubles the weights' memory on the replica.
* **``W @ x^T``**: with few rows MKL's float32 GEMM is faster with the weight as the tall left
  operand than ``x @ W^T`` (what ``F.linear`` asks for), as for a large LM head on a few rows.

Both apply to inputs of at most ``SKINNY_ROWS`` rows on CPU (``W @ x^T`` to float32 only);
anything else (prefill chunks, other dtypes, other devices) is ``F.linear``. They compute the
same dot products; results differ from ``F.linear`` by float rounding only, like any change of
GEMM kernel.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import fx

from lamina.computenode import linear_groups
from lamina.computenode.fast_ops import constant
from lamina.config import kernels_in_use
from lamina.device import advise_huge_pages, huge_page_zeros
from lamina.kernels import cpp_ext

SKINNY_ROWS = 64
PACKED_DTYPES = (torch.float32, torch.bfloat16)
# bfloat16 layers above this many rows go to oneDNN: widening bfloat16 in registers the packed
# kernel is ahead only up to ~16 rows, with AMX tiles up to ~32 (README: "bfloat16 on CPU").
# use_skinny_linear sets the limit from the packed layout.
BF16_PACKED_ROWS = 16
BF16_PACKED_ROWS_AMX = 32
_bf16_rows = BF16_PACKED_ROWS
_ext = None  # the C++ extension, once use_skinny_linear has packed a weight (saves a lookup)


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  panels: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``; ``x[..., in]``, ``weight[out, in]`` -> ``[..., out]``
    (possibly non-contiguous). ``panels``: ``weight`` packed by ``ext.pack_linear_weight``
    (then the C++ kernel runs it, in float32 math; a bfloat16 layer gets its float32 result
    rounded to bfloat16, as ``F.linear`` rounds its float32 accumulators)."""
    shape = x.shape
    rows = x.numel() // max(shape[-1], 1)
    if panels is not None and rows > 0 and (
            rows <= SKINNY_ROWS if x.dtype == torch.float32
            else x.dtype == weight.dtype and rows <= _bf16_rows) and (
            bias is None or bias.dtype in PACKED_DTYPES):
        # the decode case, once per layer per slice: one call, dtypes converted in C++ (panels
        # exist only for CPU weights, so x is on the CPU too)
        out = (_ext or cpp_ext.load()).skinny_linear(x.reshape(rows, shape[-1]), panels,
                                                     weight.shape[0], bias)
        return out.view(*shape[:-1], weight.shape[0])
    if x.device.type != "cpu" or x.dtype != torch.float32 or not 0 < rows <= SKINNY_ROWS:
        return F.linear(x, weight, bias)
    out = torch.mm(weight, x.reshape(rows, shape[-1]).t()).t()
    if bias is not None:
        out = out + bias
    return out.reshape(*shape[:-1], weight.shape[0])


def packing_available() -> bool:
    """Whether :func:`use_skinny_linear` packs weights for the C++ kernel (builds it on the
    first call unless the ``linear`` choice is ``torch``); ``packed`` without the extension
    raises."""
    choice = kernels_in_use().linear
    if choice == "torch":
        return False
    if cpp_ext.load() is not None:
        return True
    if choice == "packed":
        raise RuntimeError(f"linear kernels 'packed' need the C++ extension, which is "
                           f"unavailable ({cpp_ext.build_error()})")
    return False


def free_memory() -> int:
    """Bytes of physical memory the host has available now (``MemAvailable``; unbounded when
    it cannot be read)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 1 << 62


def _arenas(ext, weights: list[torch.Tensor | None]) -> tuple[dict, dict]:
    """Per weight dtype, one zeroed allocation that holds every packed weight of the list back
    to back, and the next free element. It is written with 4 KB pages and advised for huge
    pages once packed (:func:`advise_huge_pages`, by :func:`use_skinny_linear`): a slice streams
    its weights every step, and huge pages save TLB misses and prefetcher restarts (~3 % of a
    batch-1 pass over SmolLM2's packed weights, ~6 % at 8 rows in an earlier session), but
    faulting them in while packing can compact memory synchronously: packing SmolLM2 in a fresh
    process took 1.5-2.7 s against 0.44-0.46 s with 4 KB pages. The sizes come from packing an empty
    ``[1, K]`` weight of each dtype and K (the layout, ``[ceil(N / rows), steps(K), rows,
    lanes]``, depends on the instruction set and dtype). Returns the arenas and those layouts,
    ``(dtype, K) -> [1, steps, rows, lanes]``."""
    sizes: dict[torch.dtype, int] = {}
    layouts: dict[tuple[torch.dtype, int], torch.Size] = {}  # (dtype, K) -> an empty pack's shape
    for w in weights:
        if w is not None:
            n, k = w.shape
            if (w.dtype, k) not in layouts:
                layouts[w.dtype, k] = ext.pack_linear_weight(torch.empty(1, k, dtype=w.dtype)).shape
            _, steps, rows, lanes = layouts[w.dtype, k]
            sizes[w.dtype] = sizes.get(w.dtype, 0) + -(-n // rows) * rows * steps * lanes
    # lazy: packing writes nearly every page at once (and the padding reads as zeros)
    return {dt: (huge_page_zeros((n,), dt, commit="lazy", advise=False), 0)
            for dt, n in sizes.items()}, layouts


def pack_into(w: torch.Tensor, panels: torch.Tensor) -> bool:
    """Write ``w[N, K]`` into zeroed ``panels[P, steps, rows, lanes]`` in the C++ kernel's
    layout (``panels[p, g, r, l] = w[p * rows + r, g * lanes + l]``, zeros past N and K:
    ``pack_linear_weight``'s result), with strided copies and no temporary; False (nothing
    written) where K is not a multiple of ``lanes`` (the caller packs in C++ then)."""
    N, K = w.shape
    P, steps, rows, lanes = panels.shape
    if K % lanes or K // lanes > steps or N > P * rows:
        return False
    w, by_row = w.contiguous(), panels.permute(0, 2, 1, 3)  # [P, rows, steps, lanes]: a view
    full, kg = N // rows, K // lanes
    by_row[:full, :, :kg].copy_(w[:full * rows].view(full, rows, kg, lanes))
    if N > full * rows:
        by_row[full, :N - full * rows, :kg].copy_(w[full * rows:].view(N - full * rows, kg, lanes))
    return True


def fused_kernels():
    """The extension whose fused small ops (:mod:`lamina.computenode.fused_ops`) CPU slices
    call: the packed kernels' (``None`` where :func:`packing_available` says no)."""
    return cpp_ext.load() if packing_available() else None


def amx_layout(ext) -> bool:
    """Whether ``ext`` packs bfloat16 weights for its AMX kernel (pairs of k per step)."""
    return ext.pack_linear_weight(torch.empty(1, 0, dtype=torch.bfloat16)).shape[-1] == 2


def use_skinny_linear(gm: fx.GraphModule, pack: bool | None = None,
                      group: bool | None = None) -> int:
    """Point ``gm``'s ``aten.linear`` nodes at :func:`skinny_linear` (in place, recompiled);
    with ``pack`` (default: :func:`packing_available`) every float32 or bfloat16 CPU weight
    that is a constant of ``gm`` is packed once for the C++ kernel (a buffer
    ``_lamina_panels_<i>`` of ``gm``: a view of one huge-page allocation per dtype), unless
    twice the packed bytes exceed the host's available memory (then ``gm`` keeps the unpacked
    paths), and its node calls ``ext.packed_linear``: :func:`skinny_linear`'s choice between
    the packed kernel and ``F.linear``, made in C++. With ``group`` (default: packing, unless
    the ``linear`` choice is the exact ``gguf``, which has no group kernel), linear nodes that
    read the same rows (:func:`lamina.computenode.linear_groups.groups`) are packed back to back
    and become one ``ext.packed_linear_group`` node. Returns how many linear nodes were
    changed."""
    global _ext, _bf16_rows
    if pack is None:
        pack = packing_available()
    ext = cpp_ext.load() if pack else None
    _ext = ext or _ext
    if ext is not None:
        _bf16_rows = BF16_PACKED_ROWS_AMX if amx_layout(ext) else BF16_PACKED_ROWS
    nodes = [node for node in gm.graph.nodes if node.op == "call_function"
             and node.target is torch.ops.aten.linear.default]
    weights = [constant(gm, node.args[1]) for node in nodes]
    weights = [w if w is not None and w.dtype in PACKED_DTYPES and w.device.type == "cpu"
               and w.dim() == 2 else None for w in weights]
    if ext is not None and 2 * sum(w.nbytes for w in weights if w is not None) > free_memory():
        ext = None  # the packed copies would not fit beside what the host still has free
    arenas, layouts = _arenas(ext, weights) if ext is not None else ({}, {})
    if group is None:
        group = kernels_in_use().linear != "gguf"
    found = linear_groups.groups(nodes, weights, lambda k: layouts[torch.float32, k][2]) \
        if ext is not None and group else []
    in_group = {i: g for g in found for i in g}
    for i, (node, weight) in enumerate(zip(nodes, weights)):
        node.target = skinny_linear
        if ext is None or weight is None or (i in in_group and in_group[i][0] != i):
            continue  # a later member of a group: packed with its first
        members = in_group.get(i, [i])
        start = arenas[weight.dtype][1]
        for j in members:
            panels = _pack(weights[j], arenas, layouts)
        name = f"_lamina_panels_{i}"
        if len(members) > 1:  # the group's panels back to back: one tensor
            arena, end = arenas[weight.dtype]
            panels = arena[start:end].view(-1, *panels.shape[1:])
        gm.register_buffer(name, panels, persistent=False)
        with gm.graph.inserting_before(node):
            panels_node = gm.graph.get_attr(name)
        if len(members) > 1:
            linear_groups.use_group(gm, [nodes[j] for j in members], ext.packed_linear_group,
                                    (panels_node, SKINNY_ROWS))
            continue
        bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
        # skinny_linear's dispatch, in C++: the slice calls the extension directly
        node.target = ext.packed_linear
        node.args = (node.args[0], node.args[1], bias, panels_node, SKINNY_ROWS, _bf16_rows)
        node.kwargs = {}
    for arena, _ in arenas.values():
        advise_huge_pages(arena)  # packed: khugepaged may collapse it from now on
    if nodes:
        gm.recompile()
    return len(nodes)


def _pack(weight: torch.Tensor, arenas: dict, layouts: dict) -> torch.Tensor:
    """``weight`` packed into the next free part of its dtype's arena (advanced): its panels."""
    _, steps, rows, lanes = layouts[weight.dtype, weight.shape[1]]
    shape = (-(-weight.shape[0] // rows), steps, rows, lanes)
    arena, at = arenas[weight.dtype]
    panels = arena[at:at + math.prod(shape)].view(shape)  # zeros (huge_page_zeros)
    if not pack_into(weight.detach(), panels):
        panels.copy_(_ext.pack_linear_weight(weight.detach()))
    arenas[weight.dtype] = (arena, at + panels.numel())
    return panels
