"""``SplitModel.verify()``: the split model against the original over a flattened ragged batch.

Plain PyTorch modules follow the convention ``module(input_ids[1,T], position_ids[1,T]) -> [1,T,...]``
(per-token outputs, token dimension 1). Hugging Face causal LMs are compared on logits.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from lamina.splitter.errors import SplitError
from lamina.splitter.reference import ReferenceKV


@dataclass
class VerifyResult:
    """Largest absolute logit difference against the original model, per phase."""

    max_abs_diff: float
    prompt_diff: float
    continuation_diff: float
    num_sequences: int
    lengths: list[int] = field(default_factory=list)


def _vocab_size(model: torch.nn.Module) -> int:
    cfg = getattr(model, "config", None)
    if cfg is not None and getattr(cfg, "vocab_size", None):
        return int(cfg.vocab_size)
    for m in model.modules():
        if isinstance(m, torch.nn.Embedding):
            return m.num_embeddings
    raise SplitError(f"{type(model).__name__}: cannot tell the vocabulary size; pass seqs=")


def _oracle(model: torch.nn.Module, seq: torch.Tensor, hf: bool) -> torch.Tensor:
    pos = torch.arange(seq.numel(), device=seq.device)[None]
    with torch.no_grad():
        if hf:
            return model(input_ids=seq[None], position_ids=pos, use_cache=False).logits[0]
        out = model(seq[None], pos)
        return out[0] if isinstance(out, torch.Tensor) else out[0][0]


def _run_phase(sm, kv: ReferenceKV, chunks: list[torch.Tensor], starts: list[int]) -> torch.Tensor:
    device = chunks[0].device
    ids = torch.cat(chunks)
    pos = torch.cat([torch.arange(s, s + c.numel(), device=device) for s, c in zip(starts, chunks)])
    bounds = [0]
    for c in chunks:
        bounds.append(bounds[-1] + c.numel())

    def attend(layer, q, k, v):
        spec = sm.specs[layer]
        outs = []
        for r in range(len(chunks)):
            a, b = bounds[r], bounds[r + 1]
            outs.append(kv.attend(r, layer, q[a:b], k[a:b], v[a:b], pos[a:b], spec))
        return torch.cat(outs)

    rows = torch.arange(ids.numel(), device=device)
    with torch.no_grad():
        return sm.forward(ids, pos, rows, attend)


def verify_split(sm, seqs: list[list[int]] | None, split: float, seed: int) -> VerifyResult:
    from lamina.splitter.export import is_hf_causal_lm

    model = sm.source
    if model is None:
        raise SplitError("verify() needs the original model (SplitModel.source); a loaded "
                         "SplitModel has none: split the model again to verify it")
    device = next(model.parameters()).device
    hf = is_hf_causal_lm(model)
    if seqs is None:
        g = torch.Generator().manual_seed(seed)
        vocab = _vocab_size(model)
        seqs = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (6, 13, 9, 2)]
    if len(seqs) < 1 or any(len(s) < 2 for s in seqs):
        raise ValueError("verify() needs sequences of at least 2 tokens")
    tens = [torch.tensor(s, dtype=torch.long, device=device) for s in seqs]
    cut = [min(len(s) - 1, max(1, int(len(s) * split))) for s in seqs]
    kv = ReferenceKV()
    first = _run_phase(sm, kv, [t[:c] for t, c in zip(tens, cut)], [0] * len(tens))
    second = _run_phase(sm, kv, [t[c:] for t, c in zip(tens, cut)], cut)
    want = [_oracle(model, t, hf) for t in tens]
    want_first = torch.cat([w[:c] for w, c in zip(want, cut)])
    want_second = torch.cat([w[c:] for w, c in zip(want, cut)])
    d1 = (first.double() - want_first.double()).abs().max().item()
    d2 = (second.double() - want_second.double()).abs().max().item()
    return VerifyResult(max(d1, d2), d1, d2, len(seqs), [len(s) for s in seqs])
