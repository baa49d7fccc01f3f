"""A split on disk as source and weights: what a process reads to run the slices, without
deserialising an exported program.

Folder (format 2):

* ``split.json``: the partition, the attention specs, the slices' infos, and per slice its
  attributes (``get_attr`` target -> ``[tensor name, kind]``, kind ``p`` parameter, ``b``
  buffer, ``t`` plain tensor attribute) and the globals its code names beyond FX's own
  (name -> ``module:qualname``);
* ``slices/slice_<k>.py``: slice ``k``'s ``forward`` as FX prints it (``GraphModule.code``);
* ``weights.safetensors``: every tensor the slices read, once (tied weights stay tied).

Reading execs each slice's source and traces it back into an ``fx.GraphModule`` (the passes
of :mod:`lamina.computenode` rewrite graphs), over weights loaded from safetensors: well under
a second for SmolLM2 where ``torch.export.load`` took ~7 s. The code is run as written: a
folder is trusted as a pickle would be (the split cache is this host's own).
"""
from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx
from safetensors.torch import load_file, save_file

from lamina.splitter.errors import SplitError

FORMAT = 2
WEIGHTS = "weights.safetensors"


def _fx_builtins() -> dict[str, Any]:
    """The globals FX gives every generated ``forward`` (``torch``, ``inf``, ``device``, ...)."""
    return dict(fx.Graph().python_code("self").globals)


def _target(gm: fx.GraphModule, target: str) -> Any:
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def slice_records(slices: list[fx.GraphModule]) -> tuple[list[dict], dict[str, torch.Tensor]]:
    """Per slice ``{"attrs": ..., "globals": ...}`` (see the module docstring) and the tensors
    by name, each once (a tensor read by several slices, or tied, is stored once)."""
    builtins = _fx_builtins()
    tensors: dict[str, torch.Tensor] = {}
    names: dict[tuple, str] = {}
    records = []
    for k, gm in enumerate(slices):
        attrs = {}
        for node in gm.graph.nodes:
            if node.op != "get_attr" or node.target in attrs:
                continue
            t = _target(gm, node.target)
            if not isinstance(t, torch.Tensor):
                raise SplitError(f"slice {k} reads {node.target!r}, a {type(t).__name__}: only "
                                 "tensors can be saved")
            owner, _, leaf = node.target.rpartition(".")
            mod = gm.get_submodule(owner) if owner else gm
            kind = "p" if leaf in mod._parameters else "b" if leaf in mod._buffers else "t"
            key = (t.data_ptr(), t.dtype, tuple(t.shape), tuple(t.stride()), t.device)
            if key not in names:
                names[key] = f"t{len(names)}"
                tensors[names[key]] = t
            attrs[node.target] = [names[key], kind]
        extra = {}
        for name, obj in gm.graph.python_code("self").globals.items():
            if name in builtins and builtins[name] is obj:
                continue
            mod, qual = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
            if not mod or not qual or "<" in qual:
                raise SplitError(f"slice {k}'s code names {name!r} ({obj!r}), which cannot be "
                                 "imported back")
            extra[name] = f"{mod}:{qual}"
        records.append({"attrs": attrs, "globals": extra})
    return records, tensors


def save_slices(folder: Path, slices: list[fx.GraphModule]) -> list[dict]:
    """Write ``slices/`` and ``weights.safetensors`` into ``folder``; the records for
    ``split.json``."""
    records, tensors = slice_records(slices)
    (folder / "slices").mkdir(parents=True, exist_ok=True)
    for k, gm in enumerate(slices):
        (folder / "slices" / f"slice_{k}.py").write_text(gm.code)
    # safetensors stores whole, contiguous, unshared tensors: views of one storage are copied
    seen: set[int] = set()
    out = {}
    for name, t in tensors.items():
        ptr = t.untyped_storage().data_ptr()
        whole = t.is_contiguous() and t.storage_offset() == 0 and \
            t.numel() * t.element_size() == t.untyped_storage().nbytes()
        out[name] = t.detach().cpu() if whole and ptr not in seen else t.detach().cpu().clone()
        seen.add(ptr)
    save_file({n: t.contiguous() for n, t in out.items()}, str(folder / WEIGHTS))
    return records


def load_slices(folder: Path, records: list[dict], device: torch.device | str = "cpu"
                ) -> list[fx.GraphModule]:
    """The slices of a format-2 folder, traced back from their source over its weights."""
    try:
        weights = load_file(str(folder / WEIGHTS), device=str(device))
    except Exception as e:  # noqa: BLE001 - a truncated or foreign file
        raise SplitError(f"{folder / WEIGHTS}: cannot read: {e}") from e
    builtins = _fx_builtins()
    slices = []
    for k, rec in enumerate(records):
        holder = torch.nn.Module()
        for target, (name, kind) in rec["attrs"].items():
            _attach(holder, target, weights[name], kind)
        scope = dict(builtins)
        for name, where in rec["globals"].items():
            mod, _, qual = where.partition(":")
            obj: Any = importlib.import_module(mod)
            for part in qual.split("."):
                obj = getattr(obj, part)
            scope[name] = obj
        path = folder / "slices" / f"slice_{k}.py"
        try:
            exec(compile(path.read_text(), str(path), "exec"), scope)  # noqa: S102 - see above
            root = type(f"Slice{k}Code", (torch.nn.Module,), {"forward": scope["forward"]})()
            for target, (name, _) in rec["attrs"].items():  # every tensor a buffer while tracing
                _attach(root, target, weights[name], "b")
            graph = _ProxyTensors().trace(root)
        except Exception as e:  # noqa: BLE001 - a folder written by another version
            raise SplitError(f"{path}: cannot trace the slice back: {e}") from e
        slices.append(fx.GraphModule(holder, graph, class_name=f"Slice{k}"))
    return slices


class _ProxyTensors(fx.Tracer):
    """A tracer for which every tensor attribute read is a ``get_attr`` proxy. FX's own proxies
    parameters only, so an op on a buffer alone (``inv_freq.to(float32)`` in a 16-bit split)
    would run while tracing and be folded into an unnamed ``_tensor_constant``."""

    def getattr(self, attr: str, attr_val: Any, parameter_proxy_cache: dict) -> Any:
        if isinstance(attr_val, torch.Tensor):
            names = self.__dict__.get("_tensor_names")
            if names is None:
                names = self._tensor_names = {id(t): n for n, t in
                                              self.root.named_buffers(remove_duplicate=False)}
            if id(attr_val) in names:
                return self.create_proxy("get_attr", names[id(attr_val)], (), {})
        return super().getattr(attr, attr_val, parameter_proxy_cache)


def _attach(root: torch.nn.Module, target: str, t: torch.Tensor, kind: str) -> None:
    """Put ``t`` at dotted ``target`` under ``root`` (making empty modules on the way) as a
    parameter, buffer or plain attribute."""
    *path, leaf = target.split(".")
    mod = root
    for part in path:
        if part not in mod._modules:
            mod.add_module(part, torch.nn.Module())
        mod = mod._modules[part]
    if kind == "p":
        mod.register_parameter(leaf, torch.nn.Parameter(t, requires_grad=False))
    elif kind == "b":
        mod.register_buffer(leaf, t)
    else:
        setattr(mod, leaf, t)
