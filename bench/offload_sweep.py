"""Where attention offloading pays: decode throughput over batch x context x KV format (issue 44).

Each cell decodes ``--steps`` tokens for ``batch`` requests whose contexts of ``ctx`` tokens
are synthetic: the prompt's KV is written as zeros straight into the memory nodes
(:meth:`lamina.engine.engine.Engine.add_precomputed`; attention's speed does not depend on the
values), so a cell costs its decode steps, not a prefill of ``batch x ctx`` tokens (the real
prefill, with greedy agreement, is ``bench/offload.py``'s). Setups, per KV format, one
``LLM`` each, reused across cells (its pools sized for the largest cell):

* ``homogeneous``: ``device="cpu:0", memory=1, memory_device="cpu:0", placement="inproc"``:
  dense slices and attention in one process on one core;
* ``lamina``: ``device="cpu:0", memory=1, memory_device="cpu:1", placement="procs"`` with
  ``--micro-batches`` (default 2) rotating: the memory node owns the second core;
* ``hf``: transformers' forward over a ``DynamicCache`` of zeros of the cell's shape, one token
  per request per step, on ``--hf-threads`` threads (float32; only cells whose cache fits in
  ``--hf-max-gb``).

Timed per cell: the wall of ``--steps`` decode steps after one warm-up step, tokens/s =
batch x steps / wall. Reported: lamina / homogeneous, lamina / hf, and the *no-wait ceiling*:
homogeneous step time over lamina's compute-only step time (the homogeneous step minus its
attention, from the memory node's ATTEND time), the ratio lamina would reach if the replica
never waited on the node; and the micro-batches per step the stage times call for: overlapping
dense slices and attention saves at most the shorter stage, so below a ceiling of
``PIPELINE_PAYS`` one micro-batch (no rotation, no extra hand-offs) is the pick. A PNG plots
lamina / homogeneous over the grid.

    python bench/offload_sweep.py                                  # 16/64/128 x 1k/4k, bf16 + int8
    python bench/offload_sweep.py --batches 16 64 --contexts 1024 --formats int8 --steps 4

Writes ``bench/results/offload_sweep_cpu.{json,md,png}``. Cells that do not fit in this
host's memory (pools of ``batch x ctx`` tokens in the format) are skipped and listed.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from lamina import LLM, SamplingParams  # noqa: E402  (before torch: the OpenMP policy)
from lamina.kernels.kv_format import kv_format  # noqa: E402

import torch  # noqa: E402

RESULTS = ROOT / "bench" / "results"
SLAB = 256
PIPELINE_PAYS = 1.15  # the no-wait ceiling from which pipelining's overlap pays its hand-offs


def fits(batch: int, ctx: int, fmt: str, layers: int, hkv: int, d: int, max_gb: float) -> bool:
    return batch * (ctx + 64) * layers * hkv * kv_format(fmt).bytes_per_token_head(d) \
        <= max_gb * (1 << 30)


def decode(llm: LLM, batch: int, ctx: int, steps: int, shape: tuple[int, int, int]) -> dict:
    """``batch`` synthetic contexts of ``ctx`` tokens, one warm-up step, then ``steps`` timed
    decode steps; the node's ATTEND time over them (STATS)."""
    d = llm.deployment
    eng = d.instances[0].engine
    params = SamplingParams(temperature=0, max_tokens=steps + 1, ignore_eos=True)
    vocab = eng.vocab_size or 1000
    reqs = [eng.add_precomputed([(7 * r + 13 * j) % (vocab - 3) + 3 for j in range(ctx)],
                                params, shape) for r in range(batch)]
    d.step()  # warm-up: the last prompt tokens
    node = d.instances[0].nodes[0]
    attend0 = node.stats().attend_us
    t0 = time.perf_counter()
    while d.has_work():
        d.step()
    wall = time.perf_counter() - t0
    attend = (node.stats().attend_us - attend0) / 1e6
    done = sum(len(r.output_ids) - 1 for r in reqs)
    for r in reqs:
        eng.forget(r.req_id)
    return dict(wall=wall, tokens=done, tok_s=done / wall, attend_s=attend,
                step_ms=wall / steps * 1e3)


def hf_decode(model, batch: int, ctx: int, steps: int) -> dict:
    from transformers import DynamicCache
    cfg = model.config
    hkv = cfg.num_key_value_heads
    d = cfg.hidden_size // cfg.num_attention_heads
    cache = DynamicCache(config=cfg)
    z = torch.zeros(batch, hkv, ctx, d)
    for layer in range(cfg.num_hidden_layers):
        cache.update(z.clone(), z.clone(), layer)
    ids = torch.full((batch, 1), 5)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", "`past_key_values` is deprecated", FutureWarning)
        model(ids, past_key_values=cache, use_cache=True)  # warm-up
        t0 = time.perf_counter()
        for _ in range(steps):
            model(ids, past_key_values=cache, use_cache=True)
        wall = time.perf_counter() - t0
    return dict(wall=wall, tok_s=batch * steps / wall, step_ms=wall / steps * 1e3)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--batches", type=int, nargs="+", default=[16, 64, 128])
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--formats", nargs="+", default=["bfloat16", "int8"])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--micro-batches", type=int, default=2)
    ap.add_argument("--max-gb", type=float, default=8.0, help="largest pool this host can hold")
    ap.add_argument("--hf-threads", type=int, default=2)
    ap.add_argument("--hf-max-gb", type=float, default=4.0)
    ap.add_argument("--out", type=Path, default=RESULTS)
    a = ap.parse_args(argv)
    from lamina.models import load_model
    hf = load_model(a.model, dtype=torch.float32).model
    cfg = hf.config
    shape = (cfg.num_hidden_layers, cfg.num_key_value_heads,
             cfg.hidden_size // cfg.num_attention_heads)
    cells = [(b, c) for c in a.contexts for b in a.batches]
    rows, skipped = [], []
    for fmt in a.formats:
        ok = [(b, c) for b, c in cells if fits(b, c, fmt, *shape, a.max_gb)]
        skipped += [dict(format=fmt, batch=b, ctx=c) for b, c in cells if (b, c) not in ok]
        if not ok:
            continue
        tokens = max(b * (c + a.steps + 2) for b, c in ok) + SLAB
        res: dict = {}
        for setup, kw in (("homogeneous", dict(memory_device="cpu:0", placement="inproc")),
                          ("lamina", dict(memory_device="cpu:1", placement="procs",
                                          micro_batches=a.micro_batches,
                                          pipeline="rotational"))):
            with LLM(a.model, device="cpu:0", memory=1, kv_dtype=fmt, kv_cache_tokens=tokens,
                     max_num_seqs=max(b for b, _ in ok), **kw) as llm:
                for b, c in ok:
                    res[setup, b, c] = r = decode(llm, b, c, a.steps, shape)
                    print(f"{fmt} {setup} batch {b} ctx {c}: {r['tok_s']:.1f} tok/s "
                          f"({r['step_ms']:.0f} ms/step, attention {r['attend_s']:.2f} s)",
                          flush=True)
        for b, c in ok:
            h, lam = res["homogeneous", b, c], res["lamina", b, c]
            compute_s = max(h["wall"] - h["attend_s"], 1e-9)
            ceiling = h["wall"] / max(compute_s, h["attend_s"])
            row = dict(format=fmt, batch=b, ctx=c, homogeneous_tok_s=h["tok_s"],
                       lamina_tok_s=lam["tok_s"], vs_homogeneous=lam["tok_s"] / h["tok_s"],
                       attention_share=h["attend_s"] / h["wall"], no_wait_ceiling=ceiling,
                       # overlapping the two stages saves at most the shorter one: below
                       # PIPELINE_PAYS one micro-batch (no rotation's hand-offs) is the choice
                       micro_batches=a.micro_batches if ceiling >= PIPELINE_PAYS else 1)
            if fits(b, c, "float32", *shape, a.hf_max_gb):
                torch.set_num_threads(a.hf_threads)
                hr = hf_decode(hf, b, c, a.steps)
                row.update(hf_tok_s=hr["tok_s"], vs_hf=lam["tok_s"] / hr["tok_s"])
            rows.append(row)
    md = ["# Attention offloading over batch x context x KV format (bench/offload_sweep.py)", "",
          f"{a.model}; 2-core host: lamina = replica on core 0 + memory node on core 1 "
          f"({a.micro_batches} micro-batches, rotational), homogeneous = both on core 0 in one "
          f"process, hf = transformers on {a.hf_threads} threads (float32 cache); synthetic "
          f"contexts, {a.steps} timed decode steps per cell.", "",
          "    python bench/offload_sweep.py " + " ".join(argv or sys.argv[1:]), "",
          "| KV | batch | context | homogeneous tok/s | lamina tok/s | lamina / homogeneous | "
          "no-wait ceiling | attention share (homog.) | micro-batches that pay | hf tok/s | "
          "lamina / hf |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        hfc = (f"{r['hf_tok_s']:.1f} | {r['vs_hf']:.2f}x" if "hf_tok_s" in r else "- | -")
        md.append(f"| {r['format']} | {r['batch']} | {r['ctx']} | {r['homogeneous_tok_s']:.1f} | "
                  f"{r['lamina_tok_s']:.1f} | {r['vs_homogeneous']:.2f}x | "
                  f"{r['no_wait_ceiling']:.2f}x | {100 * r['attention_share']:.0f}% | "
                  f"{r['micro_batches']} | {hfc} |")
    if skipped:
        md += ["", "Skipped (pools beyond --max-gb on this host): " + ", ".join(
            f"{s['format']} {s['batch']} x {s['ctx']}" for s in skipped)]
    text = "\n".join(md) + "\n"
    print(text)
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "offload_sweep_cpu.json").write_text(json.dumps(dict(rows=rows, skipped=skipped),
                                                             indent=1))
    (a.out / "offload_sweep_cpu.md").write_text(text)
    plot(rows, a.out / "offload_sweep_cpu.png")
    print(f"wrote {a.out / 'offload_sweep_cpu'}.json, .md and .png")


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4))
    for fmt in sorted({r["format"] for r in rows}):
        for ctx in sorted({r["ctx"] for r in rows}):
            pts = [(r["batch"], r["vs_homogeneous"]) for r in rows
                   if r["format"] == fmt and r["ctx"] == ctx]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=f"{fmt}, context {ctx}")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch (requests)")
    ax.set_ylabel("lamina / homogeneous, decode tok/s")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
