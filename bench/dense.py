"""One dense pass over the builtin model on CPU: what the slices' op calls cost, in one run.

A compute replica runs every slice of the split model once per decode step (attention
excluded). This times that pass for T tokens on one core with the packed C++ linear layers in
three forms of the slices, interleaved pass by pass:

* ``exported``: every small ATen op called as ``torch.ops.aten.<op>.<overload>`` (what
  ``torch.export`` emits);
* ``bindings``: the same ops through their public bindings (:mod:`lamina.computenode.fast_ops`);
* ``fused``: the small-op chains fused into one C++ call each
  (:mod:`lamina.computenode.fused_ops`), the rest through bindings, each packed linear layer
  one call into the extension, run by the slices' generated Python code;
* ``native``: what a CPU replica runs: the ``fused`` slices, each as one C++ program
  (:mod:`lamina.computenode.native_slice`: the same calls, no Python between them).

Attention is a fixed stand-in (zeros), so the pass is the dense part alone. Reports each form's
median ms per pass, the op calls per pass, and whether the logits equal the exported form's
(bit for bit for ``bindings``; ``fused`` rounds differently: its largest logit difference and
whether the argmax agrees; ``native`` must equal ``fused`` bit for bit). Saves
bench/results/dense_cpu.{json,md}.

    python bench/dense.py                   # T = 1 8 32, 9 rounds
"""
from __future__ import annotations

import argparse
import copy
import json
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from lamina.computenode.cpu_linear import use_skinny_linear  # noqa: E402
from lamina.computenode.fast_ops import flatten_constants, use_fast_ops  # noqa: E402
from lamina.computenode.replica import ComputeReplica  # noqa: E402
from lamina.models import load_model  # noqa: E402
from lamina.splitter import split_model  # noqa: E402

FORMS = ("exported", "bindings", "fused", "native")


def make_form(split, form: str):
    """``(split, runner)``: ``split`` (a fresh copy) with its slices in ``form``, and what runs a
    slice (None: its generated code)."""
    if form in ("fused", "native"):
        replica = ComputeReplica(split, "cpu")
        if form == "native" and replica.programs is None:
            raise SystemExit("the native form needs the C++ extension")
        return replica.split, replica.runner() if form == "native" else None
    for gm in split.slices:
        if form == "bindings":
            use_fast_ops(gm)
        use_skinny_linear(gm)
        flatten_constants(gm)
    return split, None


def one_pass(form, tokens: int, heads: int, head_dim: int) -> torch.Tensor:
    split, run = form
    ids = torch.randint(100, 1000, (tokens,), generator=torch.Generator().manual_seed(tokens))
    o = torch.zeros(tokens, heads, head_dim)
    with torch.inference_mode():
        return split.forward(ids, torch.arange(64, 64 + tokens), torch.arange(tokens),
                             lambda k, q, key, v: o, run)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    loaded = load_model(args.model)
    cfg = loaded.model.config
    heads, head_dim = cfg.num_attention_heads, cfg.hidden_size // cfg.num_attention_heads
    base = split_model(loaded.model)
    splits = {f: make_form(copy.deepcopy(base), f) for f in FORMS}
    calls = {f: sum(1 for gm in s.slices for n in gm.graph.nodes if n.op == "call_function")
             for f, (s, _) in splits.items()}
    rows = []
    for t in args.tokens:
        times: dict[str, list[float]] = {f: [] for f in FORMS}
        out: dict[str, torch.Tensor] = {}
        for r in range(args.rounds + 1):
            for f in FORMS[r % len(FORMS):] + FORMS[:r % len(FORMS)]:  # rotate round by round
                t0 = time.perf_counter()
                out[f] = one_pass(splits[f], t, heads, head_dim)
                if r:  # round 0 warms every form up
                    times[f].append(time.perf_counter() - t0)
        ms = {f: 1e3 * statistics.median(times[f]) for f in FORMS}
        ex = out["exported"]
        rows.append({"tokens": t, **{f"{f}_ms": ms[f] for f in FORMS},
                     "exported_over_fused": statistics.median(
                         a / b for a, b in zip(times["exported"], times["fused"])),
                     "fused_over_native": statistics.median(
                         a / b for a, b in zip(times["fused"], times["native"])),
                     "native_identical": bool(torch.equal(out["native"], out["fused"])),
                     "bindings_identical": bool(torch.equal(out["bindings"], ex)),
                     "fused_max_diff": float((out["fused"] - ex).abs().max()),
                     "fused_argmax_same": bool(torch.equal(out["fused"].argmax(-1),
                                                           ex.argmax(-1)))})
        print(f"T={t:3d}  " + "  ".join(f"{f} {ms[f]:7.1f} ms" for f in FORMS))
    lines = [f"# Dense pass over {args.model} on one core: op call paths (median of "
             f"{args.rounds} interleaved rounds; {platform.processor() or platform.machine()})",
             "", "op calls per pass: " + ", ".join(f"{f} {calls[f]}" for f in FORMS), "",
             "| tokens | exported ms | bindings ms | fused ms | native ms | exported / fused "
             "(same round) | fused / native (same round) | bindings bit-identical | fused max "
             "logit diff | fused argmax same | native = fused bit for bit |",
             "|---:|---:|---:|---:|---:|---:|---:|---|---:|---|---|"]
    yes = {True: "yes", False: "NO"}
    lines += [f"| {r['tokens']} | {r['exported_ms']:.1f} | {r['bindings_ms']:.1f} | "
              f"{r['fused_ms']:.1f} | {r['native_ms']:.1f} | {r['exported_over_fused']:.2f}x | "
              f"{r['fused_over_native']:.2f}x | {yes[r['bindings_identical']]} | "
              f"{r['fused_max_diff']:.1e} | {yes[r['fused_argmax_same']]} | "
              f"{yes[r['native_identical']]} |" for r in rows]
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {"model": args.model, "rounds": args.rounds, "op_calls": calls,
            "torch": torch.__version__, "machine": platform.processor() or platform.machine()}
    (args.out / "dense_cpu.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    (args.out / "dense_cpu.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
