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


def tiny_case(kind: str, tmp_path_factory, prompts: list[list[int]], max_new_tokens: int):
    """A tiny random ``kind`` model saved to a folder, with its HF greedy outputs for
    ``prompts`` (EOS off, so every output has ``max_new_tokens``): ``(folder, outputs)``."""
    from tiny_models import tiny_folder, tiny_model
    folder = tiny_folder(kind, tmp_path_factory.mktemp(kind))
    model = tiny_model(kind)
    model.generation_config.eos_token_id = None
    return folder, hf_greedy(model, prompts, max_new_tokens)
