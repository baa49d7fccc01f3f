"""ComputeReplica: runs the slices of a split model over a step's flattened tokens and samples.

The replica owns the slices (on its device) and a :class:`Sampler`. Attention is not its
business: ``execute`` takes an ``attend(layer, q, k, v) -> o`` callable that ships q/k/v to the
memory nodes and returns the merged output ``o[T,H,D]`` (DESIGN.md §3, steps 3-5).
"""
from __future__ import annotations

import torch

from lamina.computenode.cpu_linear import use_skinny_linear
from lamina.computenode.sampling import Sampler
from lamina.splitter import SplitModel
from lamina.types import SamplingParams, StepPlan


class ComputeReplica:
    def __init__(self, split: SplitModel, device: torch.device | str = "cpu",
                 sampler: Sampler | None = None):
        self.split = split
        self.device = torch.device(device)
        self.sampler = sampler or Sampler()
        if self.device.type == "cpu":
            for gm in split.slices:
                use_skinny_linear(gm)

    @torch.inference_mode()
    def logits(self, plan: StepPlan, attend) -> torch.Tensor:
        """Logits ``[R, V]`` of ``plan.sample_rows`` only."""
        return self.split.forward(plan.token_ids.to(self.device), plan.positions.to(self.device),
                                  plan.sample_rows.to(self.device), attend)

    def execute(self, plan: StepPlan, attend, req_ids: list[int],
                params: list[SamplingParams]) -> torch.Tensor:
        """Run the step and sample one token per sample row: ``int64[R]`` on CPU."""
        logits = self.logits(plan, attend)
        if logits.shape[0] == 0:
            return torch.empty(0, dtype=torch.long)
        return self.sampler.sample(logits, req_ids, params)

    def release(self, req_id: int) -> None:
        self.sampler.release(req_id)
