"""Decoders that advance one greedy decode step per call, so that a benchmark can interleave
the steps of several systems and machine noise hits them all alike (``bench/e2e.py``).

* :class:`HFStepper`: a Hugging Face model on a left-padded batch, doing per step what
  ``generate`` does: one forward over the last tokens with the KV cache (``DynamicCache``),
  then argmax of the last logits.
* :class:`LaminaStepper`: an :class:`~lamina.llm.LLM`'s engine; its requests are prefilled at
  construction, and every :meth:`~LaminaStepper.step` is one iteration that decodes one token
  for every request of the batch.

Both own only their batch's state; ``model`` and ``llm`` stay the caller's.
"""
from __future__ import annotations

import inspect

import torch

from lamina.benchmark.measure import left_padded
from lamina.types import SamplingParams


class HFStepper:
    """Greedy decoding of ``prompts`` (token id lists) by an HF causal LM, one step per call."""

    def __init__(self, model, prompts: list[list[int]], pad_id: int) -> None:
        from transformers import DynamicCache

        ids, mask = left_padded(prompts, pad_id)
        dev = model.device
        self.model, self.mask = model, mask.to(dev)
        self.cache = DynamicCache()
        # newer transformers renamed ``past_key_values`` to ``cache`` (and warn on the old name)
        params = inspect.signature(model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self.position = (self.mask.cumsum(-1) - 1).clamp(min=0)
        self.tokens = self._forward(ids.to(dev), self.position)

    @torch.inference_mode()
    def _forward(self, ids: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        out = self.model(input_ids=ids, attention_mask=self.mask, position_ids=position,
                         use_cache=True, logits_to_keep=1, **{self._cache_kw: self.cache})
        return out.logits[:, -1].argmax(-1, keepdim=True)

    def step(self) -> None:
        """Feed the last tokens, append the next greedy token of every row."""
        self.mask = torch.cat([self.mask, torch.ones_like(self.tokens)], dim=-1)
        self.position = self.position[:, -1:] + 1
        self.tokens = self._forward(self.tokens, self.position)


class LaminaStepper:
    """Greedy decoding of ``prompts`` by ``llm``'s engine, one decode iteration per call.

    ``steps`` is how many calls of :meth:`step` will follow; the requests are sized so that
    the last call finishes them all (and frees their KV). Raises ``RuntimeError`` if a step
    does not decode exactly one token for every request (e.g. too little KV memory)."""

    def __init__(self, llm, prompts: list[list[int]], steps: int) -> None:
        self.engine = llm.deployment
        params = SamplingParams(temperature=0, max_tokens=steps + 1, ignore_eos=True)
        self.reqs = [self.engine.add_request(p, params) for p in prompts]
        while not all(r.output_ids for r in self.reqs):  # prefill (maybe several chunks)
            self.engine.step()
        if any(len(r.output_ids) != 1 for r in self.reqs):
            raise RuntimeError("the prefill did not end on the same step for every request")

    def step(self) -> None:
        before = [len(r.output_ids) for r in self.reqs]
        self.engine.step()
        if any(len(r.output_ids) != n + 1 for r, n in zip(self.reqs, before)):
            raise RuntimeError("a decode step did not produce one token for every request")
