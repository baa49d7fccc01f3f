"""Greedy generation with Hugging Face transformers, one prompt at a time (the oracle)."""
from __future__ import annotations

import torch


def hf_greedy(model: torch.nn.Module, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    outs = []
    for p in prompts:
        ids = torch.tensor([p])
        with torch.no_grad():
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=max_new_tokens, pad_token_id=0)
        outs.append(gen[0, len(p):].tolist())
    return outs
