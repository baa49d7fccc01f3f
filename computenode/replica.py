"""ComputeReplica: runs the slices of a split model over a step's flattened tokens and samples.

The replica owns the slices (on its device) and a :class:`Sampler`. Attention is not its
business: the replica core (:mod:`lamina.computenode.runner`) runs one slice at a time
(:meth:`ComputeReplica.run_slice`), sends its q/k/v to the memory nodes and feeds the merged
output ``o[T,H,D]`` to the next slice.
With ``cuda_graph_tokens > 0`` (a CUDA device only) every slice is captured as CUDA graphs for
steps of up to that many tokens and replayed there (:mod:`lamina.computenode.cuda_graphs`).
``gguf_blocks`` (:func:`lamina.computenode.gguf_linear.read_blocks`; CPU only): the linear
layers' decode-sized calls run on a GGUF's own quantised blocks. On CPU each slice then runs as
a C++ program where ``KernelConfig.slices`` allows (:mod:`lamina.computenode.native_slice`),
and where every slice has one, a lone micro-batch's whole step can run in one C++ call
(:meth:`ComputeReplica.run_step`).
"""
from __future__ import annotations

import torch

from lamina.computenode.cpu_linear import fused_kernels, use_skinny_linear
from lamina.computenode.cuda_graphs import SliceGraphs, capture_sizes
from lamina.computenode.fast_ops import flatten_constants, use_fast_ops
from lamina.computenode.fused_ops import fuse_small_ops
from lamina.computenode.gguf_linear import use_gguf_linear
from lamina.computenode.native_slice import native_programs, step_program
from lamina.computenode.sampling import Sampler
from lamina.splitter import SplitModel
from lamina.splitter.model import STEP_INPUTS
from lamina.types import NativeExchange, SamplingParams, StepPlan


class ComputeReplica:
    def __init__(self, split: SplitModel, device: torch.device | str = "cpu",
                 sampler: Sampler | None = None, cuda_graph_tokens: int = 0,
                 gguf_blocks: dict | None = None):
        self.split = split
        self.device = torch.device(device)
        if gguf_blocks is not None and self.device.type != "cpu":
            raise ValueError("the 'gguf' linear kernels run on CPU replicas only")
        self.sampler = sampler or Sampler()
        fused = fused_kernels() if self.device.type == "cpu" else None
        for gm in split.slices:
            if fused is not None:
                fuse_small_ops(gm, fused)
            use_fast_ops(gm)
            if self.device.type == "cpu":
                use_skinny_linear(gm)
                if gguf_blocks is not None:  # after packing: calls of many rows use the panels
                    use_gguf_linear(gm, gguf_blocks)
            flatten_constants(gm)  # last: the slice is on its device, its panels made
        self.graphs: SliceGraphs | None = None
        if cuda_graph_tokens > 0:  # raises where the device cannot capture them
            self.graphs = SliceGraphs(split, self.device, capture_sizes(cuda_graph_tokens))
        self.programs = native_programs(split) if self.device.type == "cpu" else None
        self.step = step_program(split, self.programs)  # every slice has a program: the chain

    # -- one slice at a time (the replica core drives these: runner.py) ------------------------------
    def begin(self, plan: StepPlan) -> dict[str, torch.Tensor]:
        """The values slice 0 of ``plan`` reads, on this replica's device."""
        return self.split.start(plan.token_ids.to(self.device), plan.positions.to(self.device),
                                plan.sample_rows.to(self.device))

    @torch.inference_mode()
    def run_slice(self, k: int, values: dict[str, torch.Tensor]):
        """Run slice k on ``values`` (moved to this replica's device first: a context arriving
        from another replica). Returns :meth:`SplitModel.advance`'s ``(context, qkv, logits)``."""
        values = {n: t.to(self.device, non_blocking=True) for n, t in values.items()}
        return self.split.advance(k, values, self.runner())

    def run_step(self, step_id: int, values: dict[str, torch.Tensor], exchange: NativeExchange,
                 stamps: torch.Tensor | None = None):
        """Slices 0, 1, ... of step ``step_id`` in one C++ call from :meth:`begin`'s ``values``,
        each layer's attention by ``exchange`` (needs :attr:`step`). Returns ``(k, sent,
        context, qkv, logits)``: :meth:`run_slice`'s result for slice k, the last slice or the
        layer whose exchange did not answer: its ATTEND is the caller's to send, or, ``sent``,
        out already with its RESULT the caller's to receive. ``stamps`` (for a timeline):
        ``int64[slices, STAMP_COLS]``, filled as ``StepProgram.run`` says
        (``kernels/csrc/slice_program.cpp``)."""
        k, sent, out = self.step.run(step_id, [values[n] for n in STEP_INPUTS], exchange.fn,
                                     exchange.obj, stamps)
        outs = dict(zip(self.split.infos[k].outputs, out))
        return (k, sent, *self.split.outcome(k, values, outs))

    def step_stamps(self) -> torch.Tensor:
        """A buffer for :meth:`run_step`'s ``stamps``."""
        return torch.empty(len(self.split.slices), self.step.STAMP_COLS, dtype=torch.int64)

    def runner(self):
        """What runs a slice (``SplitModel.advance``'s ``run``): the CUDA graphs, else the C++
        programs, else None (the slices' generated code)."""
        if self.graphs is not None:
            return self.graphs
        return self._run_program if self.programs is not None else None

    def _run_program(self, k: int, args: list[torch.Tensor]):
        """Slice k by its C++ program, or by its graph where it has none."""
        program = self.programs[k]
        return program.run(args) if program is not None else self.split.slices[k](*args)

    def sample(self, logits: torch.Tensor, req_ids: list[int], params: list[SamplingParams],
               uniforms: torch.Tensor | None = None) -> torch.Tensor:
        """One token per row of ``logits[R, V]``: ``int64[R]`` on CPU (``uniforms``: see
        :meth:`Sampler.sample`)."""
        if logits.shape[0] == 0:
            return torch.empty(0, dtype=torch.long)
        return self.sampler.sample(logits, req_ids, params, uniforms)

    def release(self, req_id: int) -> None:
        self.sampler.release(req_id)

