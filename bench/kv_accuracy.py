"""Accuracy of each KV format against float KV of the same model (issue 44).

Two measures, each format against ``float32`` KV (the model in float32):

* **Teacher-forced NLL** of a fixed text the repo ships (``bench/data/kv_accuracy.txt``, ~1,300
  tokens, one forward pass): mean negative log-likelihood per token, and its relative change.
  Computed by ``transformers`` over a cache that stores what a lamina pool of the format holds
  (:func:`fake_quant_cache`: each appended K/V row quantised and dequantised by the format's
  torch reference); ``tests/e2e`` checks that lamina's greedy output over 8-bit pools equals
  ``transformers`` over this cache, token for token, so the NLL is lamina's.
* **Greedy agreement, teacher-forced**: the share of the text's positions whose argmax next
  token equals float32 KV's (same pass).
* **Greedy agreement, free-running**, through lamina itself (``LLM(model, kv_dtype=...)``, in process, one
  memory node): a fixed set of chat prompts, ``--max-tokens`` each; the share of generated
  tokens equal, position by position, to the float32-KV run's, and the share of prompts whose
  whole output is equal.

    python bench/kv_accuracy.py                  # smollm2, every format
    python bench/kv_accuracy.py --formats int8 k16v8 --max-tokens 32

Writes ``bench/results/kv_accuracy_cpu.{json,md}`` (``--out``).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from lamina import LLM, SamplingParams  # noqa: E402  (before torch work: the OpenMP policy)
from lamina.kernels.kv_format import kv_format  # noqa: E402
from lamina.models import load_model  # noqa: E402
from lamina.types import KV_DTYPES  # noqa: E402

TEXT = ROOT / "bench" / "data" / "kv_accuracy.txt"
FORMATS = [n for n in KV_DTYPES if n != "auto"]
PROMPTS = [
    "What is the capital of France?", "Write a haiku about the sea.",
    "Explain what a lighthouse lens does, in two sentences.", "List three prime numbers.",
    "How do I reverse a list in Python?", "Summarise the water cycle for a child.",
    "What is 17 times 23?", "Give me a name for a grey cat.",
    "Why is the sky blue?", "Translate 'good morning' into Spanish.",
    "Write the first line of a mystery novel.", "What does a memory node hold?",
    "Describe a storm at sea.", "What is the boiling point of water in Fahrenheit?",
    "Suggest a healthy breakfast.", "What is a prime number?"]


def fake_quant_cache(model: torch.nn.Module, kv_dtype: str):
    """A ``transformers`` cache that holds what a lamina pool of format ``kv_dtype`` holds:
    every K/V row it is given is quantised and dequantised by the format's torch reference
    (:meth:`lamina.kernels.kv_format.KVPart.quantize`) before attention reads it."""
    from transformers import DynamicCache
    fmt = kv_format(kv_dtype)

    def stored(part, x):  # x [B, Hkv, T, D]
        return part.dequantize(*part.quantize(x)).to(x.dtype)

    class FakeQuantCache(DynamicCache):
        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            return super().update(stored(fmt.k, key_states), stored(fmt.v, value_states),
                                  layer_idx, *args, **kwargs)
    return FakeQuantCache(config=model.config)


def nll(model: torch.nn.Module, ids: torch.Tensor, kv_dtype: str) -> tuple[float, torch.Tensor]:
    """Mean NLL (nats per token) of ``ids[1:]`` given the text before, one forward pass over a
    cache in ``kv_dtype``; and the greedy (argmax) next token at every position."""
    with torch.no_grad():
        logits = model(ids[None], past_key_values=fake_quant_cache(model, kv_dtype),
                       use_cache=True).logits[0, :-1].float()
    return torch.nn.functional.cross_entropy(logits, ids[1:]).item(), logits.argmax(-1)


def greedy(model: str, prompts: list[list[int]], max_tokens: int, **settings) -> list:
    """Greedy outputs of ``prompts`` through ``LLM(model, memory=1, **settings)`` (EOS
    ignored)."""
    with LLM(model, memory=1, **settings) as llm:
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens,
                                                    ignore_eos=True), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def inputs(tok) -> tuple[torch.Tensor, list[list[int]]]:
    """The NLL text's token ids and the chat prompts' (with the generation prompt)."""
    ids = torch.tensor(tok(TEXT.read_text())["input_ids"])
    chats = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True)
             for p in PROMPTS]
    return ids, [list(c["input_ids"]) if hasattr(c, "keys") else list(c) for c in chats]


def write(out: Path, stem: str, text: str, meta: dict, rows: list[dict]) -> None:
    """Print ``text`` and save it as ``out/stem.md``, with ``meta`` and the rows' numbers as
    ``out/stem.json``."""
    print(text)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(
        dict(meta, rows=[{k: v for k, v in r.items() if k not in ("out", "top1")} for r in rows]),
        indent=1))
    (out / f"{stem}.md").write_text(text)
    print(f"wrote {out / stem}.json and .md")


def cells(r: dict, prompts: int) -> str:
    """A row's table cells after its label: NLL, vs the first row, perplexity, agreements."""
    return (f"{r['nll']:.4f} | {100 * r['nll_rel']:+.2f}% | {r['ppl']:.3f} | "
            f"{r['top1_agreement']:.4f} | {r['agreement']:.3f} | {r['identical']} / {prompts} |")


def compare(rows: list[dict]) -> None:
    """Each row (``nll``, ``top1`` argmax per position, ``out`` greedy outputs) against the
    first: adds ``nll_rel``, ``ppl``, ``top1_agreement``, ``agreement`` (generated tokens
    equal position by position, mean over outputs) and ``identical`` (whole outputs equal)."""
    base = rows[0]
    for r in rows:
        same = [sum(x == y for x, y in zip(o, b)) / max(1, len(b))
                for o, b in zip(r["out"], base["out"])]
        r.update(nll_rel=r["nll"] / base["nll"] - 1, ppl=math.exp(r["nll"]),
                 top1_agreement=(r["top1"] == base["top1"]).float().mean().item(),
                 agreement=sum(same) / len(same), identical=sum(s == 1.0 for s in same))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--formats", nargs="+", default=FORMATS, choices=FORMATS)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    a = ap.parse_args(argv)
    formats = ["float32"] + [f for f in a.formats if f != "float32"]
    loaded = load_model(a.model, dtype=torch.float32)
    ids, chats = inputs(loaded.tokenizer)
    rows = []
    for f in formats:
        t0 = time.perf_counter()
        n, top1 = nll(loaded.model, ids, f)
        out = greedy(a.model, chats, a.max_tokens, kv_dtype=f)
        rows.append(dict(format=f, nll=n, top1=top1, out=out, s=time.perf_counter() - t0))
        print(f"{f}: NLL {n:.4f} ({time.perf_counter() - t0:.0f} s)", flush=True)
    compare(rows)
    md = ["# KV formats: accuracy against float32 KV (bench/kv_accuracy.py)", "",
          f"{a.model} in float32; NLL: teacher-forced over `bench/data/kv_accuracy.txt` "
          f"({len(ids)} tokens); agreement: {len(chats)} chat prompts x {a.max_tokens} greedy "
          "tokens through `LLM(kv_dtype=...)`, position by position against float32 KV.", "",
          "    python bench/kv_accuracy.py " + " ".join(argv or sys.argv[1:]), "",
          "Greedy agreement, teacher-forced: the argmax next token at each position of the "
          "text equals float32 KV's (errors do not compound). Free-running: generated tokens "
          "equal position by position (one early difference changes the rest of that output; "
          "bfloat16 KV shows what 16 bits already change).", "",
          "| KV format | NLL (nats/token) | vs float32 | perplexity | greedy agreement, "
          "teacher-forced | free-running | outputs identical |",
          "|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        md.append(f"| {r['format']} | " + cells(r, len(chats)))
    write(a.out, "kv_accuracy_cpu", "\n".join(md) + "\n",
          dict(model=a.model, text_tokens=len(ids), prompts=len(chats),
               max_tokens=a.max_tokens), rows)


if __name__ == "__main__":
    main()
