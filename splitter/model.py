"""``SplitModel``: the slices of a model cut at its attentions, with one ``AttentionSpec`` each."""
from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Callable

import torch
import torch.fx as fx

from lamina.splitter.errors import SplitError
from lamina.splitter.export import export_program, unlift
from lamina.splitter.folder import FORMAT, load_slices, save_slices
from lamina.splitter.graph import Partition, partition
from lamina.splitter.reference import ReferenceKV
from lamina.splitter.slices import ATTN_OUT, SliceInfo, build_slices
from lamina.splitter.verify import VerifyResult, verify_split
from lamina.types import AttentionSpec

STEP_INPUTS = ("input_ids", "position_ids", "logits_to_keep")  # what start() makes, every step

#: attend(layer, q[T,H,D], k[T,Hkv,D], v[T,Hkv,Dv]) -> o[T,H,Dv]
AttendFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
#: run(k, args) -> slice k's outputs, computed some other way than ``slices[k](*args)``
SliceRunner = Callable[[int, list], tuple]


def specs_from_graph(gm: fx.GraphModule, part: Partition) -> list[AttentionSpec]:
    nodes = {n.name: n for n in gm.graph.nodes}
    specs = []
    for i, name in enumerate(part.attentions):
        q, k, _, scale, window, softcap = nodes[name].args
        _, H, D = q.meta["val"].shape
        specs.append(AttentionSpec(layer=i, num_heads=int(H), num_kv_heads=int(k.meta["val"].shape[1]),
                                   head_dim=int(D), scale=float(scale), window=window,
                                   softcap=softcap))
    return specs


class SplitModel:
    """n+1 slices and n AttentionSpecs. ``slices[k]`` takes the inputs named in
    ``infos[k].inputs`` and returns the values named in ``infos[k].outputs`` (see
    :mod:`lamina.splitter.slices`). ``source`` is the original module, kept for ``verify()``;
    ``program`` the exported program it was cut from and ``graph`` its unlifted graph (both
    None once read back from a folder)."""

    def __init__(self, slices: list[fx.GraphModule], infos: list[SliceInfo],
                 specs: list[AttentionSpec], part: Partition, *,
                 program: torch.export.ExportedProgram | None = None,
                 graph: fx.GraphModule | None = None, source: torch.nn.Module | None = None):
        self.slices, self.infos, self.specs = slices, infos, specs
        self.partition = part
        self.program, self.graph = program, graph
        self.source = source

    @classmethod
    def from_program(cls, program: torch.export.ExportedProgram, part: Partition | None = None,
                     source: torch.nn.Module | None = None,
                     graph: fx.GraphModule | None = None) -> "SplitModel":
        """Cut ``program`` (its unlifted ``graph``, if made already) at ``part`` (None: at
        every attention)."""
        graph = graph if graph is not None else unlift(program)
        part = part if part is not None else partition(graph)
        slices, infos = build_slices(graph, part)
        return cls(slices, infos, specs_from_graph(graph, part), part, program=program,
                   graph=graph, source=source)

    @property
    def num_layers(self) -> int:
        return len(self.specs)

    # -- running -------------------------------------------------------------------------------
    def run_slice(self, k: int, values: dict[str, torch.Tensor],
                  run: SliceRunner | None = None) -> dict[str, torch.Tensor]:
        """Run slice k on the named inputs it needs; returns its outputs by name. ``run(k,
        args)``, when given, computes the slice instead of ``slices[k](*args)`` (e.g. by
        replaying a captured CUDA graph) and must return the same outputs."""
        try:
            args = [values[name] for name in self.infos[k].inputs]
        except KeyError as e:
            raise KeyError(f"slice {k} needs input {e} (has {sorted(values)})") from None
        outs = self.slices[k](*args) if run is None else run(k, args)
        return dict(zip(self.infos[k].outputs, outs))

    def start(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
              sample_rows: torch.Tensor) -> dict[str, torch.Tensor]:
        """The values slice 0 reads, for flattened tokens ``input_ids[T]``, ``position_ids[T]``
        and the rows to produce logits for, ``sample_rows[R]`` (all int64, on one device)."""
        return dict(zip(STEP_INPUTS, (input_ids[None], position_ids[None], sample_rows)))

    def advance(self, k: int, values: dict[str, torch.Tensor], run: SliceRunner | None = None
                ) -> tuple[dict[str, torch.Tensor] | None, tuple | None, torch.Tensor | None]:
        """Run slice k. Returns ``(context, (q, k, v), None)`` for a slice that ends at attention
        k (set ``context[ATTN_OUT]`` to its output ``o[T,H,Dv]`` and call ``advance(k+1, ...)``),
        or ``(None, None, result)`` for the last slice (logits of the sample rows for HF causal
        LMs, ``[R, V]``; the whole first output otherwise). The context holds the values later
        slices read (the minimum cut), so moving it is moving the micro-batch."""
        return self.outcome(k, values, self.run_slice(k, values, run))

    def outcome(self, k: int, values: dict[str, torch.Tensor], out: dict[str, torch.Tensor]
                ) -> tuple[dict[str, torch.Tensor] | None, tuple | None, torch.Tensor | None]:
        """:meth:`advance`'s result from the outputs ``out`` (by name) of slice k run on
        ``values`` (however it ran)."""
        if k == len(self.specs):
            result = out["output0"][0]  # drop the batch dimension of 1
            rows = values["logits_to_keep"]
            return None, None, result if "logits_to_keep" in self.infos[k].inputs else result[rows]
        context = {n: values[n] for n in STEP_INPUTS}
        context.update({n: t for n, t in out.items() if n not in ("q", "k", "v")})
        return context, (out["q"], out["k"], out["v"]), None

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
                sample_rows: torch.Tensor, attend: AttendFn,
                run: SliceRunner | None = None) -> torch.Tensor:
        """Chain all slices over flattened tokens; ``attend`` computes each attention. Returns
        what the last :meth:`advance` returns."""
        values = self.start(input_ids, position_ids, sample_rows)
        for k in range(len(self.slices)):
            context, qkv, result = self.advance(k, values, run)
            if context is None:
                return result
            context[ATTN_OUT] = attend(k, *qkv).contiguous()
            values = context
        raise AssertionError("unreachable")

    # -- checking ------------------------------------------------------------------------------
    def verify(self, seqs: list[list[int]] | None = None, split: float = 0.5,
               seed: int = 0) -> VerifyResult:
        """Chain the slices through reference attention over a flattened ragged batch and compare
        with the original model. Phase 1 feeds each sequence's first ``split`` fraction (whole
        prompts); phase 2 feeds the rest at continuation positions, attending over the KV cached in
        phase 1. Returns the largest absolute logit differences."""
        return verify_split(self, seqs, split, seed)

    # -- persistence ---------------------------------------------------------------------------
    def save(self, folder: str | Path) -> Path:
        """Write the folder :mod:`lamina.splitter.folder` describes (the slices' source, their
        weights as safetensors, ``split.json``)."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        records = save_slices(folder, self.slices)
        meta = {"format": FORMAT, "slice_of": self.partition.slice_of,
                "contexts": self.partition.contexts, "attentions": self.partition.attentions,
                "replicated": sorted(self.partition.replicated),
                "bytes_per_token": self.partition.bytes_per_token,
                "specs": [asdict(s) for s in self.specs], "infos": [asdict(i) for i in self.infos],
                "slices": records}
        (folder / "split.json").write_text(json.dumps(meta, indent=1))
        return folder

    @classmethod
    def load(cls, folder: str | Path, device: torch.device | str = "cpu") -> "SplitModel":
        """Read a folder :meth:`save` wrote, its weights onto ``device``."""
        folder = Path(folder)
        meta_path = folder / "split.json"
        if not meta_path.is_file():
            raise SplitError(f"{meta_path}: missing (not a saved SplitModel folder)")
        try:
            meta = json.loads(meta_path.read_text())
            if meta.get("format") != FORMAT:
                raise SplitError(f"format {meta.get('format')!r}, this version reads {FORMAT}")
            part = Partition(slice_of=meta["slice_of"], contexts=meta["contexts"],
                             attentions=meta["attentions"], replicated=set(meta["replicated"]),
                             bytes_per_token=meta["bytes_per_token"])
            specs = [AttentionSpec(**s) for s in meta["specs"]]
            infos = [SliceInfo(**i) for i in meta["infos"]]
            slices = load_slices(folder, meta["slices"], device)
        except SplitError as e:
            raise SplitError(f"{folder}: cannot read saved SplitModel: {e}") from e
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise SplitError(f"{folder}: cannot read saved SplitModel: {e}") from e
        return cls(slices, infos, specs, part)


def split_model(model: torch.nn.Module) -> SplitModel:
    """Export ``model`` and cut it at every attention."""
    program = export_program(model)
    return SplitModel.from_program(program, source=model, graph=unlift(program))
