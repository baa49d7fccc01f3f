"""Export a model to one ATen graph over flattened tokens, with every attention as one
``torch.ops.lamina.attention`` node.

The exported graph's inputs are ``input_ids[1,T]`` (int64), ``position_ids[1,T]`` (int64) and, for
Hugging Face causal LMs, ``logits_to_keep[R]`` (int64 row indices whose logits are computed), with
dynamic T and R. Hugging Face models are traced with the ``lamina`` attention implementation
registered in transformers' ``AttentionInterface``; other modules are traced as they are and each
``aten.scaled_dot_product_attention`` (causal, no mask, batch 1) is rewritten into the lamina op.
"""
from __future__ import annotations

import inspect
import operator
import warnings

import torch
import torch.fx as fx

from lamina.splitter.errors import SplitError
from lamina.splitter.ops import ATTENTION_OP, register_hf_attention

_SDPA = torch.ops.aten.scaled_dot_product_attention.default
_MAX_TOKENS = 1 << 20


class _HFCausalLM(torch.nn.Module):
    """Calls an HF causal LM over flattened tokens and returns the kept rows' logits ``[1,R,V]``."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.m = model

    def forward(self, input_ids, position_ids, logits_to_keep):
        return self.m(input_ids=input_ids, position_ids=position_ids,
                      logits_to_keep=logits_to_keep, use_cache=False).logits


def is_hf_causal_lm(model: torch.nn.Module) -> bool:
    return (hasattr(model, "config") and hasattr(model.config, "model_type")
            and "logits_to_keep" in inspect.signature(model.forward).parameters)


def unlift(ep: torch.export.ExportedProgram) -> fx.GraphModule:
    """The program as a pruned ``GraphModule`` holding its parameters as attributes."""
    try:
        gm = ep.module(check_guards=False)
    except TypeError:  # older torch has no check_guards
        gm = ep.module()
    _prune(gm)
    return gm


def _prune(gm: fx.GraphModule) -> None:
    """Keep only nodes the outputs depend on (drops guards, metadata asserts, dead code)."""
    out = next(n for n in gm.graph.nodes if n.op == "output")
    live: set[fx.Node] = set()
    stack = [out]
    while stack:
        n = stack.pop()
        if n in live:
            continue
        live.add(n)
        stack.extend(n.all_input_nodes)
    for n in reversed(list(gm.graph.nodes)):
        if n not in live and n.op != "placeholder":
            gm.graph.erase_node(n)
    gm.graph.lint()
    gm.recompile()


def _example_inputs(hf: bool, device: torch.device) -> tuple[tuple, tuple]:
    T, R = 7, 3
    ids = torch.zeros(1, T, dtype=torch.long, device=device)
    pos = torch.arange(T, device=device)[None]
    t_dim = torch.export.Dim("T", min=2, max=_MAX_TOKENS)
    if not hf:
        return (ids, pos), ({1: t_dim}, {1: t_dim})
    keep = torch.arange(R, device=device)
    r_dim = torch.export.Dim("R", min=1, max=_MAX_TOKENS)
    return (ids, pos, keep), ({1: t_dim}, {1: t_dim}, {0: r_dim})


def _export(module: torch.nn.Module, args: tuple, dynamic: tuple) -> torch.export.ExportedProgram:
    try:
        with warnings.catch_warnings():
            # torch.export's own pytree code warns about its own deprecated LeafSpec check;
            # nothing a user of Lamina can act on.
            warnings.filterwarnings("ignore", message=".*LeafSpec.*", category=FutureWarning)
            ep = torch.export.export(module, args, dynamic_shapes=dynamic, strict=False)
            return ep.run_decompositions({})
    except SplitError:
        raise
    except Exception as e:
        raise SplitError(f"torch.export failed for {type(module).__name__}: {e}") from e


def _sdpa_as_lamina(node_name: str):
    """A replacement for one SDPA node that checks it is expressible and calls the lamina op."""

    def sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None,
             enable_gqa=False):
        if attn_mask is not None:
            raise SplitError(f"node '{node_name}': scaled_dot_product_attention with an explicit "
                             "attn_mask cannot be split (only causal attention is expressible)")
        if not is_causal:
            raise SplitError(f"node '{node_name}': non-causal scaled_dot_product_attention "
                             "cannot be split (only causal self-attention is expressible)")
        if dropout_p:
            raise SplitError(f"node '{node_name}': attention dropout cannot be split")
        if q.dim() != 4 or q.shape[0] != 1:
            raise SplitError(f"node '{node_name}': expected q[1,H,T,D] over flattened tokens, "
                             f"got shape {tuple(q.shape)}")
        if q.shape[-2] != k.shape[-2]:
            raise SplitError(f"node '{node_name}': queries and keys have different lengths "
                             "(cross-attention cannot be split)")
        s = float(scale) if scale is not None else q.shape[-1] ** -0.5
        o = ATTENTION_OP(q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1),
                         s, None, None)
        return o.transpose(0, 1).unsqueeze(0)

    return sdpa


def export_program(model: torch.nn.Module) -> torch.export.ExportedProgram:
    """Export ``model`` (eval mode, on its device and dtype) to an ATen program whose inputs are ``input_ids``, ``position_ids`` and, for HF causal LMs,
    ``logits_to_keep``. Raises :class:`SplitError` naming the module or node on failure."""
    hf = is_hf_causal_lm(model)
    try:
        device = next(model.parameters()).device
    except StopIteration:
        device = torch.device("cpu")
    args, dynamic = _example_inputs(hf, device)
    if hf:
        register_hf_attention()
        previous = model.config._attn_implementation
        model.set_attn_implementation("lamina")
        try:
            with torch.no_grad():
                return _export(_HFCausalLM(model), args, dynamic)
        finally:
            model.set_attn_implementation(previous)
    with torch.no_grad():
        ep = _export(model, args, dynamic)
        gm = unlift(ep)
        sdpa_nodes = [n for n in gm.graph.nodes if n.target is _SDPA]
        if not sdpa_nodes:
            return ep
        for n in sdpa_nodes:
            n.target = _sdpa_as_lamina(n.name)
        gm.recompile()
        return _export(gm, args, dynamic)


def attention_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is ATTENTION_OP]


def is_getitem(n: fx.Node) -> bool:
    return n.op == "call_function" and n.target is operator.getitem
