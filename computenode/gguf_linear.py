"""The slices' linear layers on a GGUF's own quantised blocks (the ``gguf`` linear kernel choice).

A GGUF model is loaded (by transformers) with its weights dequantised to float32. With
``KernelConfig(linear="gguf")`` a CPU replica also reads the file's blocks of the linear
weights it supports (Q4_0, Q4_1, Q8_0: ``kernels/csrc/quant_linear_cpu.cpp``) and runs
decode-sized calls on them: 0.56-1.06 bytes a weight where float32 streams 4. The kernel
dequantises each block in registers to exactly the float32 values transformers loaded, so
outputs differ from the float32 model's by float rounding only (the order of the sums).

* :func:`read_blocks` maps a LLaMA-architecture GGUF's tensors to transformers' parameter
  names (``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``; the token
  embedding also stands for a tied ``lm_head.weight``) and undoes llama.cpp's row permutation
  of the query and key weights (the rotary layout), as transformers does for the floats.
* Q4_K weights run under ``gguf-q8`` only; under ``gguf`` they stay on the float32 panels.
* :func:`use_gguf_linear` points each packed linear node (:func:`~lamina.computenode.cpu_linear.
  use_skinny_linear`) whose weight has blocks at :func:`gguf_linear`: calls of up to
  :data:`QUANT_ROWS` rows run on the blocks, larger ones on the float32 panels, as before.

With ``KernelConfig(linear="gguf-q8")`` the nodes call :func:`gguf_q8_linear` instead: every
float32 call's rows are quantised to 8 bits per block of 32 (ggml's Q8_1) and multiplied with
integer dot products (``kernels/csrc/quant_dot_cpu.cpp``, on the blocks repacked 8 output rows
at a time), as llama.cpp does: fewer instructions per weight than dequantising, and faster than
the float32 panels and ``F.linear`` at every row count ``bench/linear.py`` measures (1-256),
at the cost of rounding the activations (``bench/gguf_accuracy.py`` measures it against the
float model).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import fx

from lamina.computenode.fast_ops import constant
from lamina.computenode.linear_groups import retarget
from lamina.config import GGUF_KERNELS, kernels_in_use
from lamina.kernels import cpp_ext

SUPPORTED = {2: "Q4_0", 3: "Q4_1", 8: "Q8_0", 12: "Q4_K"}  # ggml type -> name
EXACT = (2, 3, 8)  # the types quant_linear (the exact ``gguf`` kernel) reads; Q4_K: gguf-q8 only
BLOCK_BYTES = {2: 18, 3: 20, 8: 34, 12: 18}  # bytes per 32 weights (Q4_K: 144 per 256)
QUANT_ROWS = 4  # up to this many rows the blocks beat the float32 panels (bench/linear.py)
_HF = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
       "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
       "ffn_down": "mlp.down_proj"}
_ext = None


class GGUFLinearError(ValueError):
    """The model cannot run its linear layers on GGUF blocks (not a GGUF, another
    architecture, no supported blocks)."""


def _unpermute(rows: int, n_head: int) -> np.ndarray:
    """Row order that undoes llama.cpp's query/key permutation (transformers'
    ``_reverse_permute_weights`` applied to row indices)."""
    idx = np.arange(rows)
    return idx.reshape(n_head, rows // n_head // 2, 2).swapaxes(2, 1).reshape(rows)


def read_blocks(path: str | Path) -> dict[str, tuple[int, torch.Tensor]]:
    """transformers parameter name -> ``(ggml type, blocks uint8 [N, K / 32 * bytes])`` for
    each linear weight of the GGUF at ``path`` in a :data:`SUPPORTED` type."""
    import gguf

    reader = gguf.GGUFReader(str(path))

    def field(name: str):
        f = reader.fields.get(name)
        return None if f is None else f.parts[f.data[0]].tolist()[0]

    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    if arch != "llama":
        raise GGUFLinearError(f"{path}: GGUF linear kernels read LLaMA-architecture files; this "
                              f"one is {arch!r}")
    heads, kv_heads = field("llama.attention.head_count"), field("llama.attention.head_count_kv")
    names = {t.name for t in reader.tensors}
    out: dict[str, tuple[int, torch.Tensor]] = {}
    for t in reader.tensors:
        kind = int(t.tensor_type)
        if kind not in SUPPORTED or t.data.ndim != 2:
            continue
        parts = t.name.split(".")
        if t.name == "token_embd.weight":
            hf = ["model.embed_tokens.weight"] + ([] if "output.weight" in names
                                                  else ["lm_head.weight"])
        elif t.name == "output.weight":
            hf = ["lm_head.weight"]
        elif len(parts) == 4 and parts[0] == "blk" and parts[2] in _HF:
            hf = [f"model.layers.{parts[1]}.{_HF[parts[2]]}.weight"]
        else:
            continue
        blocks = np.asarray(t.data)
        if parts[-2] in ("attn_q", "attn_k"):
            blocks = blocks[_unpermute(blocks.shape[0], heads if parts[-2] == "attn_q"
                                       else kv_heads)]
        tensor = torch.from_numpy(np.array(blocks, copy=True))  # owned: the file is mapped
        for name in hf:
            out[name] = (kind, tensor)
    if not out:
        raise GGUFLinearError(f"{path}: no linear weight in a supported block type "
                              f"({', '.join(SUPPORTED.values())})")
    return out


def blocks_for(model: str, device: torch.device | str) -> dict | None:
    """The blocks a replica of ``model`` on ``device`` runs on: :func:`read_blocks` of the
    model's GGUF where this process's ``linear`` kernel choice is ``gguf`` or ``gguf-q8`` (an
    error on a non-CPU device or a model that is no GGUF), else None."""
    if kernels_in_use().linear not in GGUF_KERNELS:
        return None
    if torch.device(device).type != "cpu":
        raise GGUFLinearError("the 'gguf' linear kernels run on CPU replicas only")
    from lamina.models import gguf_file
    return read_blocks(gguf_file(model))


def gguf_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                panels: torch.Tensor, max_rows: int, max_rows_same: int, blocks: torch.Tensor,
                kind: int) -> torch.Tensor:
    """``F.linear(x, weight, bias)``: on ``blocks`` for float32 calls of up to
    :data:`QUANT_ROWS` rows, else ``packed_linear`` on the float32 panels."""
    if x.dtype == torch.float32 and x.numel() <= QUANT_ROWS * x.shape[-1]:
        return _ext.quant_linear(x, blocks, kind, bias)
    return _ext.packed_linear(x, weight, bias, panels, max_rows, max_rows_same)


def gguf_q8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                   panels: torch.Tensor, max_rows: int, max_rows_same: int,
                   packed: torch.Tensor, kind: int) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` approximately: float32 calls on ``packed``
    (``ext.pack_q8_weight`` of the blocks) with 8-bit activations, others exactly by
    ``packed_linear`` on the float32 panels."""
    if x.dtype == torch.float32:
        return _ext.quant_linear_q8(x, packed, weight.shape[0], kind, bias)
    return _ext.packed_linear(x, weight, bias, panels, max_rows, max_rows_same)


def gguf_q8_linear_group(x: torch.Tensor, weights: list[torch.Tensor], panels: torch.Tensor,
                         max_rows: int, packed: torch.Tensor, kind: int) -> list[torch.Tensor]:
    """:func:`gguf_q8_linear` of several weights that read ``x`` (a group node of
    :mod:`lamina.computenode.linear_groups`): ``packed`` is their blocks concatenated, then
    repacked; ``x`` is quantised once."""
    if x.dtype == torch.float32:
        return _ext.quant_linear_q8_group(x, packed, [w.shape[0] for w in weights], kind)
    return _ext.packed_linear_group(x, weights, panels, max_rows)


def _blocks_of(blocks: dict, w_node) -> str | None:
    """The key of ``blocks`` that ``w_node`` (a get_attr of a weight) reads, under any prefix."""
    if not isinstance(w_node, fx.Node) or w_node.op != "get_attr":
        return None
    return next((k for k in blocks if w_node.target == k or w_node.target.endswith("." + k)), None)


def _group_on_blocks(gm: fx.GraphModule, node: fx.Node, blocks: dict, ext, n: int) -> bool:
    """Point a ``packed_linear_group`` node at :func:`gguf_q8_linear_group` where every weight
    has blocks of one type, whole groups of 8 rows; whether it did."""
    names = [_blocks_of(blocks, w) for w in node.args[1]]
    if any(name is None for name in names) or len({blocks[k][0] for k in names}) != 1:
        return False
    kind = blocks[names[0]][0]
    for name, w_node in zip(names, node.args[1]):
        weight, b = constant(gm, w_node), blocks[name][1]
        N, K = weight.shape
        if b.shape[0] != N or b.shape[1] != K // 32 * BLOCK_BYTES[kind] or N % 8:
            return False
    attr = f"_lamina_blocks_{n}"
    gm.register_buffer(attr, ext.pack_q8_weight(torch.cat([blocks[k][1] for k in names]), kind),
                       persistent=False)
    with gm.graph.inserting_before(node):
        b_node = gm.graph.get_attr(attr)
    retarget(node, gguf_q8_linear_group, (*node.args[2:4], b_node, kind))
    return True


def use_gguf_linear(gm: fx.GraphModule, blocks: dict[str, tuple[int, torch.Tensor]]) -> int:
    """Point ``gm``'s packed linear nodes whose weight (a constant named after transformers'
    parameter, under any prefix) has ``blocks`` at :func:`gguf_linear`, or at
    :func:`gguf_q8_linear` (with the blocks repacked) where this process's linear choice is
    ``gguf-q8``; checks shapes. Under ``gguf-q8`` a group node
    (:mod:`lamina.computenode.linear_groups`) whose weights all have blocks of one type runs on
    them too (:func:`gguf_q8_linear_group`). In place, recompiled; returns how many nodes were
    changed."""
    global _ext
    ext = cpp_ext.load()
    if ext is None:
        raise GGUFLinearError(f"GGUF linear kernels need the C++ extension: "
                              f"{cpp_ext.build_error()}")
    _ext = ext
    q8 = kernels_in_use().linear == "gguf-q8"
    packs: dict[int, torch.Tensor] = {}  # id(blocks) -> repacked: a tied head's blocks once
    n = 0
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target is ext.packed_linear_group:
            if q8 and _group_on_blocks(gm, node, blocks, ext, n):
                n += 1
            continue
        if node.op != "call_function" or node.target is not ext.packed_linear:
            continue
        w_node = node.args[1]
        weight = constant(gm, w_node)
        name = _blocks_of(blocks, w_node)
        if weight is None or name is None or weight.dtype != torch.float32:
            continue
        kind, b = blocks[name]
        if not q8 and kind not in EXACT:
            continue  # stays on the float32 panels: exact, as the gguf choice promises
        N, K = weight.shape
        if b.shape[0] != N or b.shape[1] != K // 32 * BLOCK_BYTES[kind]:
            raise GGUFLinearError(f"{name}: blocks {tuple(b.shape)} do not fit weight {N}x{K}")
        if q8:
            if id(b) not in packs:
                packs[id(b)] = ext.pack_q8_weight(b, kind)
            b = packs[id(b)]
        attr = f"_lamina_blocks_{n}"
        gm.register_buffer(attr, b, persistent=False)
        with gm.graph.inserting_before(node):
            b_node = gm.graph.get_attr(attr)
        node.target = gguf_q8_linear if q8 else gguf_linear
        node.args = (*node.args, b_node, kind)
        n += 1
    if n:
        gm.recompile()
    return n
