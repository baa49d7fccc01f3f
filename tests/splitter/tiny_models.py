"""Tiny random Hugging Face models of several architectures (float32, CPU, seeded)."""
from __future__ import annotations

import torch
import transformers

COMMON = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=4, max_position_embeddings=128)


def tiny_config(arch: str) -> transformers.PretrainedConfig:
    c = COMMON
    if arch == "llama":
        return transformers.LlamaConfig(**c, num_key_value_heads=2)
    if arch == "qwen2":
        return transformers.Qwen2Config(**c, num_key_value_heads=2)
    if arch == "mistral":  # sliding window smaller than the test sequences
        return transformers.MistralConfig(**c, num_key_value_heads=1, sliding_window=4)
    if arch == "gpt2":
        return transformers.GPT2Config(vocab_size=96, n_embd=32, n_layer=2, n_head=4, n_positions=128)
    if arch == "opt":
        return transformers.OPTConfig(vocab_size=96, hidden_size=32, ffn_dim=64, num_hidden_layers=2,
                                      num_attention_heads=4, max_position_embeddings=128,
                                      word_embed_proj_dim=32)
    if arch == "gpt_neox":
        return transformers.GPTNeoXConfig(**c, rotary_pct=0.5)
    if arch == "phi3":
        return transformers.Phi3Config(**c, num_key_value_heads=2, pad_token_id=0)
    if arch == "gemma2":  # logit softcap and alternating sliding window
        return transformers.Gemma2Config(**{**c, "num_hidden_layers": 3}, num_key_value_heads=2,
                                         head_dim=8, sliding_window=4, attn_logit_softcapping=2.0,
                                         final_logit_softcapping=5.0)
    raise KeyError(arch)


ARCHS = ["llama", "qwen2", "mistral", "gpt2", "opt", "gpt_neox", "phi3", "gemma2"]


def tiny_model(arch: str, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config(arch), dtype=torch.float32)
    return model.eval()


def tiny_folder(arch: str, folder) -> str:
    """Save ``tiny_model(arch)`` as an HF folder, with EOS disabled so outputs run to
    ``max_tokens`` (random weights would stop at arbitrary points); returns the path."""
    model = tiny_model(arch)
    model.generation_config.eos_token_id = None
    model.save_pretrained(folder)
    return str(folder)
