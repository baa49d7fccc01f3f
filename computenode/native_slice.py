"""A CPU slice run in C++: its FX graph translated once into a ``SliceProgram``.

After :class:`~lamina.computenode.replica.ComputeReplica` has rewritten a slice for the CPU
(fused small ops, packed or GGUF linear layers, public bindings, flat constants), what is left
of a decode pass beyond the weight stream is the generated Python code calling ~25 ops a
layer, several microseconds each on a small CPU. :func:`slice_program` translates the graph
into the instructions of ``kernels/csrc/slice_program.cpp``, which runs them in C++ with the
GIL released: ATen ops boxed through the dispatcher (the kernels the bindings reach), this
extension's kernels called directly. Same kernels, same order: the outputs equal the graph's
bit for bit (``tests/computenode/test_native_slice.py``).

A graph with anything else (a Python function, an argument of a kind the program does not
carry: a device, a layout) is not translated: :func:`slice_program` raises
:class:`NotTranslatable` naming the node, and under ``auto`` that slice keeps its Python code.
``KernelConfig.slices`` chooses: ``auto`` (the program where the extension builds and the
slice translates), ``native`` (that, or an error naming the node), ``fx`` (the generated code).
"""
from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx

from lamina.computenode import gguf_linear
from lamina.computenode.fast_ops import FAST, constant
from lamina.config import kernels_in_use
from lamina.kernels import cpp_ext
from lamina.splitter.model import STEP_INPUTS
from lamina.splitter.slices import ATTN_OUT

__all__ = ["NotTranslatable", "native_programs", "slice_program", "step_program"]

# opcodes of slice_program.cpp
ATEN, SIZE, GETITEM, PACKED_LINEAR, QUANT_LINEAR, QUANT_LINEAR_Q8, RMS_NORM, SILU_MUL, ROPE, \
    GGUF_LINEAR, GGUF_Q8_LINEAR, PACKED_LINEAR_GROUP, GGUF_Q8_LINEAR_GROUP, ADD_RMS_NORM, \
    HEADS = range(15)
KERNEL_OPS = {"packed_linear": PACKED_LINEAR, "quant_linear": QUANT_LINEAR,
              "quant_linear_q8": QUANT_LINEAR_Q8, "rms_norm": RMS_NORM, "silu_mul": SILU_MUL,
              "rope": ROPE, "add_rms_norm": ADD_RMS_NORM}
_OVERLOAD = {binding: op for op, binding in FAST.items()}  # a binding back to its ATen overload
# c10::ScalarType codes of the dtypes an exported slice passes
_SCALAR_TYPES = {torch.uint8: 0, torch.int8: 1, torch.int16: 2, torch.int32: 3, torch.int64: 4,
                 torch.float16: 5, torch.float32: 6, torch.float64: 7, torch.bool: 11,
                 torch.bfloat16: 15}


class NotTranslatable(ValueError):
    """A slice the program cannot run (the message names the node and why)."""


def slice_program(gm: fx.GraphModule, ext: Any | None = None) -> Any:
    """``gm`` (a CPU slice after the replica's rewrites) as ``ext.SliceProgram``, whose
    ``run(list of inputs)`` returns ``gm``'s outputs as a list. Raises :class:`NotTranslatable`
    for a graph it cannot carry, and ``RuntimeError`` where the extension does not build.
    ``ext``: the loaded extension (default :func:`cpp_ext.load`); every kernel the graph calls
    must be this module's."""
    ext = ext if ext is not None else cpp_ext.load()
    if ext is None:
        raise RuntimeError(f"native slices need the C++ extension: {cpp_ext.build_error()}")
    kernels = {getattr(ext, name): op for name, op in KERNEL_OPS.items()}
    nodes = list(gm.graph.nodes)
    inputs = [n for n in nodes if n.op == "placeholder"]
    held = [n for n in nodes if n.op == "get_attr"]  # registers after the inputs, in order
    constants: list[torch.Tensor] = []
    for node in held:
        if (t := constant(gm, node)) is None:
            raise NotTranslatable(f"{node.name}: get_attr of a non-tensor {node.target!r}")
        constants.append(t)
    reg: dict[fx.Node, int] = {n: i for i, n in enumerate(inputs + held)}
    calls: list[tuple[fx.Node, int, str, str, list]] = []
    outputs: list[Any] = []
    base = len(inputs) + len(constants)
    for node in nodes:
        if node.op == "call_function":
            reg[node] = base + len(calls)
            calls.append((node, *_instruction(node, kernels, ext)))
        elif node.op == "output":
            outputs = list(node.args[0]) if isinstance(node.args[0], (tuple, list)) \
                else [node.args[0]]
        elif node.op not in ("placeholder", "get_attr"):
            raise NotTranslatable(f"{node.name}: {node.op} nodes are not carried")
    if not all(isinstance(o, fx.Node) for o in outputs):
        raise NotTranslatable("an output that is not a node's value")
    last = {}  # register -> index of the instruction that reads it last
    for i, (node, *_rest) in enumerate(calls):
        for used in node.all_input_nodes:
            last[reg[used]] = i
    keep = {reg[o] for o in outputs} | set(range(len(inputs), base))  # outputs, constants
    release: list[list[int]] = [[] for _ in calls]
    for r, i in last.items():
        if r not in keep:
            release[i].append(r)
    instrs = [(op, name, overload, [_arg(a, reg, t) for a, t in args], release[i])
              for i, (_node, op, name, overload, args) in enumerate(calls)]
    return ext.SliceProgram(len(inputs), constants, instrs, [reg[o] for o in outputs])


def _instruction(node: fx.Node, kernels: dict, ext: Any) -> tuple[int, str, str, list]:
    """``(opcode, aten name, overload, [(value, schema type or None)])`` of a call node."""
    target = node.target
    plain = [(a, None) for a in node.args]
    if node.kwargs and not isinstance(target, torch._ops.OpOverload) and target not in _OVERLOAD:
        raise NotTranslatable(f"{node.name}: keyword arguments to {target}")
    if target in kernels:
        return kernels[target], "", "", plain
    if target is getattr(ext, "heads", None):  # (x, sizes, ...): sizes a list of ints
        return HEADS, "", "", [(a, "List[int]" if i == 1 else None)
                               for i, a in enumerate(node.args)]
    if target is getattr(ext, "packed_linear_group", None):  # (x, weights, ...): a list
        return PACKED_LINEAR_GROUP, "", "", _group_args(node)
    if target is gguf_linear.gguf_q8_linear_group:
        if gguf_linear._ext is not ext:
            raise NotTranslatable(f"{node.name}: its GGUF kernels are another build's")
        return GGUF_Q8_LINEAR_GROUP, "", "", _group_args(node)
    if target is gguf_linear.gguf_linear or target is gguf_linear.gguf_q8_linear:
        if gguf_linear._ext is not ext:
            raise NotTranslatable(f"{node.name}: its GGUF kernels are another build's")
        if target is gguf_linear.gguf_q8_linear:
            return GGUF_Q8_LINEAR, "", "", plain
        return GGUF_LINEAR, "", "", plain + [(gguf_linear.QUANT_ROWS, None)]
    if target is operator.getitem:
        return GETITEM, "", "", plain
    op = _OVERLOAD.get(target, target)
    if not isinstance(op, torch._ops.OpOverload):
        raise NotTranslatable(f"{node.name}: calls {target!r}, which the program does not carry")
    if op is torch.ops.aten.sym_size.int:
        return SIZE, "", "", plain
    schema = op._schema
    args = []
    for i, a in enumerate(schema.arguments):
        if i < len(node.args):
            v = node.args[i]
        elif a.name in node.kwargs:
            v = node.kwargs[a.name]
        elif a.has_default_value():
            v = a.default_value
        else:
            raise NotTranslatable(f"{node.name}: {schema.name} without its argument {a.name}")
        args.append((v, str(a.type)))
    if len(node.args) > len(schema.arguments) or set(node.kwargs) - {a.name for a in
                                                                    schema.arguments}:
        raise NotTranslatable(f"{node.name}: arguments that {schema.name} does not take")
    return ATEN, schema.name, schema.overload_name, args


def _group_args(node: fx.Node) -> list:
    """A linear group node's arguments (``x, [weights], ...``), the weights typed as a list."""
    return [(a, "List[Tensor]" if i == 1 else None) for i, a in enumerate(node.args)]


def _arg(v: Any, reg: dict[fx.Node, int], type_: str | None) -> tuple:
    """One argument as slice_program.cpp's tagged tuple."""
    if isinstance(v, fx.Node):
        return ("r", reg[v])
    if v is None:
        return ("n",)
    if type_ in ("Tensor", "Optional[Tensor]") and isinstance(v, (bool, int, float)):
        return ("w", v)  # wrapped as a 0-dim tensor, as Python's argument parser does
    if isinstance(v, bool):
        return ("b", v)
    if isinstance(v, int):
        return ("i", v)
    if isinstance(v, float):
        return ("f", v)
    if isinstance(v, str):
        return ("s", v)
    if isinstance(v, torch.dtype) and v in _SCALAR_TYPES:
        return ("i", _SCALAR_TYPES[v])
    if isinstance(v, torch.Tensor):
        return ("t", v)
    if isinstance(v, (list, tuple)) and type_ is not None:
        kind = type_[len("Optional["):-1] if type_.startswith("Optional[") else type_
        if kind == "List[Optional[Tensor]]":
            return ("otl", [_arg(x, reg, None) for x in v])
        if kind == "List[Tensor]":
            return ("tl", [_arg(x, reg, None) for x in v])
        if kind == "List[int]" and all(isinstance(x, (fx.Node, int)) and not isinstance(x, bool)
                                       for x in v):
            return ("il", [_arg(x, reg, None) for x in v])
    raise NotTranslatable(f"an argument {v!r} ({type_ or 'no schema'}) the program does not carry")


def native_programs(split: Any) -> list | None:
    """Each slice of ``split`` (a CPU replica's ``SplitModel``, rewritten) as a C++ program
    (None for one that does not translate), as this process's ``KernelConfig.slices`` chooses:
    None for all under ``fx``, or under ``auto`` where the extension does not build;
    ``native`` raises where a slice cannot have one."""
    choice = kernels_in_use().slices
    if choice == "fx":
        return None
    ext = cpp_ext.load()
    if ext is None:
        if choice == "native":
            raise RuntimeError(f"slices='native' needs the C++ extension: "
                               f"{cpp_ext.build_error()}")
        return None
    programs = []
    for k, gm in enumerate(split.slices):
        try:
            programs.append(slice_program(gm, ext))
        except NotTranslatable as e:
            if choice == "native":
                raise NotTranslatable(f"slice {k}: {e}") from None
            programs.append(None)
    return programs


def step_program(split: Any, programs: list | None, ext: Any | None = None) -> Any | None:
    """Every slice of ``split`` chained in C++ (``ext.StepProgram``: a lone micro-batch's step
    in one call, each layer's attention by a memory node's plane in this process), from
    :func:`native_programs`' ``programs``; None where a slice has no program. Value names
    become slots: :data:`STEP_INPUTS` first, then in order of appearance."""
    if programs is None or any(p is None for p in programs):
        return None
    ext = ext if ext is not None else cpp_ext.load()
    slots = {name: i for i, name in enumerate(STEP_INPUTS)}

    def slot(name: str) -> int:
        return slots.setdefault(name, len(slots))

    inputs = [[slot(n) for n in info.inputs] for info in split.infos]
    outputs = [[slot(n) for n in info.outputs] for info in split.infos]
    qkv = [slot(n) for n in ("q", "k", "v")]
    return ext.StepProgram(programs, inputs, outputs, len(slots), qkv, slot(ATTN_OUT))
