"""Greedy generation with Hugging Face transformers, one prompt at a time (the oracle)."""
from __future__ import annotations

import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from kv_accuracy import fake_quant_cache  # noqa: E402  (the bench's oracle cache)


def hf_greedy(model: torch.nn.Module, prompts: list[list[int]], max_new_tokens: int,
              kv_dtype: str | None = None) -> list[list[int]]:
    """Greedy outputs of ``prompts``; ``kv_dtype``: over a KV cache stored in that lamina
    format (``bench/kv_accuracy.py``'s ``fake_quant_cache``)."""
    outs = []
    for p in prompts:
        ids = torch.tensor([p])
        kw = {} if kv_dtype is None else {"past_key_values": fake_quant_cache(model, kv_dtype)}
        with torch.no_grad(), warnings.catch_warnings():
            # transformers 5.2x renames past_key_values (cache); older ones know only this name
            warnings.filterwarnings("ignore", "`past_key_values` is deprecated", FutureWarning)
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=max_new_tokens, pad_token_id=0, **kw)
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
