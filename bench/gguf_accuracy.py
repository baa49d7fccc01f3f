"""Accuracy of the GGUF linear kernels against the float model (issue 42, build 3).

The builtin model is a GGUF whose linear weights ship as Q4_1 (layers) and Q8_0 (embedding and
tied head) blocks; transformers loads them dequantised to float32, and that float model is the
reference. The kernel choices:

* ``gguf``: the blocks dequantised in registers, float32 products (exact up to summation order);
* ``gguf-q8``: the activations rounded to 8 bits per block of 32 (ggml's Q8_1) and integer dot
  products, as llama.cpp multiplies its Q4_1 weights.

Measures, as ``bench/kv_accuracy.py`` does for KV formats (same text, same prompts):

* **Teacher-forced NLL** of ``bench/data/kv_accuracy.txt`` through transformers with each linear
  layer that has blocks computed by the kernel itself (``ext.quant_linear`` /
  ``ext.quant_linear_q8``), and the share of positions whose argmax equals the float model's;
* **Greedy agreement, free-running**, through lamina (``LLM(model, kernels=...)``, in process,
  one memory node): 16 chat prompts x ``--max-tokens``, generated tokens equal position by
  position to the float model's (``kernels="auto"``).

    python bench/gguf_accuracy.py            # writes bench/results/gguf_accuracy_cpu.{json,md}
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
for p in (ROOT, ROOT / "bench"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from lamina.computenode.gguf_linear import read_blocks  # noqa: E402
from lamina.kernels import cpp_ext  # noqa: E402
from lamina.models import gguf_file, load_model  # noqa: E402
from kv_accuracy import cells, compare, greedy, inputs, write  # noqa: E402

KERNELS = ("auto", "gguf", "gguf-q8")  # auto: the float32 model (the reference)


class KernelLinear(torch.nn.Module):
    """``F.linear`` of one layer by a GGUF kernel on its blocks."""

    def __init__(self, linear: torch.nn.Linear, kind: int, blocks: torch.Tensor, q8: bool):
        super().__init__()
        self.ext, self.kind, self.bias, self.n = cpp_ext.load(), kind, linear.bias, blocks.shape[0]
        self.q8 = q8
        self.blocks = self.ext.pack_q8_weight(blocks, kind) if q8 else blocks

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.q8:
            return self.ext.quant_linear_q8(x, self.blocks, self.n, self.kind, self.bias)
        return self.ext.quant_linear(x, self.blocks, self.kind, self.bias)


def with_kernel(model: torch.nn.Module, blocks: dict, kernels: str) -> list:
    """Swap each ``nn.Linear`` that has blocks for :class:`KernelLinear`; returns the undo list."""
    swapped = []
    if kernels == "auto":
        return swapped
    for name, mod in list(model.named_modules()):
        for child, lin in list(mod.named_children()):
            full = f"{name}.{child}" if name else child
            if isinstance(lin, torch.nn.Linear) and f"{full}.weight" in blocks:
                kind, b = blocks[f"{full}.weight"]
                setattr(mod, child, KernelLinear(lin, kind, b, kernels == "gguf-q8"))
                swapped.append((mod, child, lin))
    return swapped


def nll(model: torch.nn.Module, ids: torch.Tensor) -> tuple[float, torch.Tensor]:
    """Mean NLL (nats per token) of ``ids[1:]``, one forward pass; the argmax at each position."""
    with torch.no_grad():
        logits = model(ids[None]).logits[0, :-1].float()
    return torch.nn.functional.cross_entropy(logits, ids[1:]).item(), logits.argmax(-1)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    a = ap.parse_args(argv)
    if cpp_ext.load() is None:
        raise SystemExit(f"the C++ kernels are unavailable: {cpp_ext.build_error()}")
    model = "smollm2"
    loaded = load_model(model, dtype=torch.float32)
    blocks = read_blocks(gguf_file(model))
    ids, chats = inputs(loaded.tokenizer)
    rows = []
    for k in KERNELS:
        t0 = time.perf_counter()
        undo = with_kernel(loaded.model, blocks, k)
        n, top1 = nll(loaded.model, ids)
        for mod, child, lin in undo:
            setattr(mod, child, lin)
        out = greedy(model, chats, a.max_tokens, kernels=k)
        rows.append(dict(kernels=k, layers=len(undo), nll=n, top1=top1, out=out))
        print(f"{k}: NLL {n:.4f}, {len(undo)} layers on blocks ({time.perf_counter() - t0:.0f} s)",
              flush=True)
    compare(rows)
    md = ["# GGUF linear kernels: accuracy against the float model (bench/gguf_accuracy.py)", "",
          f"{model} (Q4_1 layers, Q8_0 embedding and tied head) against its float32 "
          f"dequantisation; NLL: teacher-forced over `bench/data/kv_accuracy.txt` ({len(ids)} "
          f"tokens), transformers with the kernel in every linear layer that has blocks; "
          f"free-running: {len(chats)} chat prompts x {a.max_tokens} greedy tokens through "
          "`LLM(kernels=...)`, position by position against the float model.", "",
          "    python bench/gguf_accuracy.py " + " ".join(argv or sys.argv[1:]), "",
          "| kernels | NLL (nats/token) | vs float | perplexity | greedy agreement, "
          "teacher-forced | free-running | outputs identical |",
          "|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        label = "float32 (auto)" if r["kernels"] == "auto" else r["kernels"]
        md.append(f"| {label} | " + cells(r, len(chats)))
    write(a.out, "gguf_accuracy_cpu", "\n".join(md) + "\n",
          dict(model=model, text_tokens=len(ids), prompts=len(chats), max_tokens=a.max_tokens,
               simd=cpp_ext.load().simd_features()), rows)


if __name__ == "__main__":
    main()
