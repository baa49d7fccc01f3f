"""Start-up time of an instance: how long ``LLM(...)`` takes to be ready, by split cache state.

Each measurement is a fresh Python process that builds ``LLM(model, compute=C, memory=M,
placement=P)``, generates one token and closes it (so nothing is memoised between them). Split
cache states:

* ``off``: ``LAMINA_SPLIT_CACHE=0``: every process that runs a replica exports and cuts the
  model (the engine's, and each replica process under ``procs``);
* ``cold``: an empty cache folder: the first process splits and stores, later ones read;
* ``warm``: the folder the cold run filled: every process reads the split.

Each child also reports where its seconds went (:mod:`lamina.stages`): importing lamina,
loading the model, the split (read from the cache, or export and cut, and store), the memory
nodes and compute replicas (in process: built; ``procs``: spawned until their first PING reply,
with each role's own stages, for example ``replica 0: split: read cache``, and what its own
stages leave: ``start, other`` = the process's start, imports, C++ extension checks). The
baseline, once per round in the same run: ``transformers`` loading the same model (for a builtin
alias, the GGUF it ships, dequantised) and generating one token. Prints a
table and a breakdown per placement (median over rounds) and saves
``bench/results/startup_<device>[_c<C>m<M>].{json,md}``. Never asserts speed.

    python bench/startup.py                        # smollm2, inproc and procs, ~6 minutes
    python bench/startup.py --placements procs --rounds 2
    python bench/startup.py --compute 2 --memory 2   # the README's row
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "The capital of France is"
CHILD = """
import json, sys, time
t = time.perf_counter()
from lamina import LLM, stages
from lamina.types import SamplingParams
imported = time.perf_counter() - t
if __name__ == "__main__":
    llm = LLM(sys.argv[1], compute=int(sys.argv[4]), memory=int(sys.argv[5]),
              placement=sys.argv[2], device=sys.argv[3])
    ready = time.perf_counter() - t
    record = stages.take()
    llm.generate([sys.argv[6]], SamplingParams(max_tokens=1, temperature=0.0))
    first = time.perf_counter() - t
    llm.close()
    print("READY", json.dumps({"ready": ready, "first token": first, "import lamina": imported,
                               **record}))
"""
HF_CHILD = """
import json, sys, time
t = time.perf_counter()
import torch, transformers
from lamina.models import BUILTIN_ALIASES, _alias_gguf
name = sys.argv[1]
kw = {}
if name in BUILTIN_ALIASES:  # the GGUF the alias ships, read by transformers (dequantised)
    gguf = _alias_gguf(name)
    name, kw = str(gguf.parent), {"gguf_file": gguf.name}
tok = transformers.AutoTokenizer.from_pretrained(name, **kw)
model = transformers.AutoModelForCausalLM.from_pretrained(name, dtype=torch.float32, **kw).eval()
ready = time.perf_counter() - t
ids = tok(sys.argv[2], return_tensors="pt")
with torch.no_grad():
    model.generate(**ids, max_new_tokens=1, do_sample=False)
print("READY", json.dumps({"ready": ready, "first token": time.perf_counter() - t}))
"""


def one(model: str, placement: str, device: str, cache: str, compute: int = 1,
        memory: int = 1) -> dict[str, float]:
    """One fresh process's seconds: ``ready``, ``first token`` and its stages."""
    env = dict(os.environ, LAMINA_SPLIT_CACHE=cache, PYTHONPATH=str(ROOT))
    return _run([CHILD, model, placement, device, str(compute), str(memory), PROMPT], env)


def transformers_baseline(model: str) -> dict[str, float]:
    """A fresh process that loads ``model`` with ``transformers`` (a builtin alias: its GGUF)
    and generates one token: ``ready`` (loaded) and ``first token`` seconds."""
    return _run([HF_CHILD, model, PROMPT], dict(os.environ, PYTHONPATH=str(ROOT)))


def _run(args: list[str], env: dict[str, str]) -> dict[str, float]:
    script = Path(tempfile.mkdtemp(prefix="lamina-startup-")) / "child.py"  # spawn re-imports it
    script.write_text(args[0])
    try:
        out = subprocess.run([sys.executable, str(script), *args[1:]], env=env,
                             capture_output=True, text=True, check=True).stdout
    finally:
        shutil.rmtree(script.parent, ignore_errors=True)
    return json.loads(next(x for x in out.splitlines() if x.startswith("READY")).split(" ", 1)[1])


def breakdown(runs: dict[str, list[dict[str, float]]]) -> list[str]:
    """Markdown rows: each stage's median seconds per cache state, in the order first met;
    ``other`` is what the engine's own stages leave of ``ready``."""
    names: list[str] = []
    for recs in runs.values():
        for rec in recs:
            names += [n for n in rec if n not in names and n not in ("ready", "first token")]
    top = [n for n in names if ": " not in n or n.startswith("split: ")]
    rows = []
    for n in names + ["other", "ready", "first token"]:
        cells = []
        for recs in runs.values():
            if n == "other":
                vals = [r["ready"] - sum(r.get(t, 0.0) for t in top) for r in recs]
            else:
                vals = [r[n] for r in recs if n in r]
            cells.append(f"{statistics.median(vals):.1f}" if vals else "-")
        label = f"&nbsp;&nbsp;{n}" if n not in top + ["other", "ready", "first token"] else n
        rows.append(f"| {label} | " + " | ".join(cells) + " |")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--placements", nargs="+", default=["inproc", "procs"])
    ap.add_argument("--compute", type=int, default=1)
    ap.add_argument("--memory", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    a = ap.parse_args()
    rows, hf = [], []
    for placement in a.placements:
        got: dict[str, list[dict[str, float]]] = {"off": [], "cold": [], "warm": []}
        for _ in range(a.rounds):
            with tempfile.TemporaryDirectory(prefix="lamina-startup-") as d:
                for state, cache in (("off", "0"), ("cold", d), ("warm", d)):
                    got[state].append(one(a.model, placement, a.device, cache, a.compute,
                                          a.memory))
            hf.append(transformers_baseline(a.model))  # the same minutes as lamina's runs
        med = {k: statistics.median(r["ready"] for r in v) for k, v in got.items()}
        first = statistics.median(r["first token"] for r in got["warm"])
        rows.append({"placement": placement, **{f"{k}_s": round(v, 1) for k, v in med.items()},
                     "warm_first_token_s": round(first, 1),
                     "warm_vs_off": round(med["off"] / med["warm"], 2), "runs": got})
        print(f"{placement}: off {med['off']:.1f} s, cold {med['cold']:.1f} s, "
              f"warm {med['warm']:.1f} s ({med['off'] / med['warm']:.2f}x faster warm), "
              f"warm first token {first:.1f} s", flush=True)
    hf_ready = statistics.median(r["ready"] for r in hf)
    hf_first = statistics.median(r["first token"] for r in hf)
    print(f"transformers: loaded {hf_ready:.1f} s, first token {hf_first:.1f} s", flush=True)
    md = [f"# Start-up time ({a.model}, {a.device}, {a.compute} compute replica(s), {a.memory} "
          f"memory node(s); {a.rounds} round(s), {time.strftime('%Y-%m-%d')})", "",
          "Seconds from `import lamina` to a ready `LLM` (and to its first generated token, "
          "warm cache), each in a fresh process; `transformers`: loading the same model (a "
          "builtin alias: its GGUF) and generating one token, in the same run. See the "
          "docstring of bench/startup.py.", "",
          "| placement | cache off s | cold s | warm s | warm, first token s | "
          "transformers first token / warm first token | off / warm |",
          "|---|---:|---:|---:|---:|---:|---:|"]
    md += [f"| {r['placement']} | {r['off_s']} | {r['cold_s']} | {r['warm_s']} | "
           f"{r['warm_first_token_s']} | {hf_first / r['warm_first_token_s']:.2f}x | "
           f"{r['warm_vs_off']:.2f}x |" for r in rows]
    md += [f"| transformers | | | {hf_ready:.1f} (loaded) | {hf_first:.1f} | | |"]
    for r in rows:
        md += ["", f"### Where the seconds go: {r['placement']}", "",
               "Engine-process stages, then each role's own (indented; under `procs` they run "
               "inside that role's `start`). `other`: what the engine's stages leave of "
               "`ready`.", "",
               "| stage | cache off s | cold s | warm s |", "|---|---:|---:|---:|",
               *breakdown(r["runs"])]
    text = "\n".join(md) + "\n"
    print(text)
    a.out.mkdir(parents=True, exist_ok=True)
    name = "startup_" + ("cuda" if a.device.startswith("cuda") else "cpu") + \
        ("" if (a.compute, a.memory) == (1, 1) else f"_c{a.compute}m{a.memory}")
    (a.out / f"{name}.md").write_text(text)
    (a.out / f"{name}.json").write_text(json.dumps(
        {"model": a.model, "compute": a.compute, "memory": a.memory, "rows": rows,
         "transformers": hf}, indent=1))


if __name__ == "__main__":
    main()
