"""``lamina plan --calibrate`` (also ``python bench/calibrate.py``): fit the cost model to this
machine and check its predictions against measured ``lamina bench`` runs.

    lamina plan --calibrate [--model smollm2] [--dtype float32] [--device cpu] [--out DIR]

Deployment measured: what ``lamina bench --memory 1`` runs (one compute replica, one memory
node, processes on this host; with no cores named they get disjoint cores), one micro-batch.

1. **Probes** on each role's cores: peak FLOP/s of a 2048^3 matmul on the compute cores;
   copy bandwidth ((read + write) bytes / s of a 256 MiB ``copy_``) on the memory cores.
2. **Fit set**: decode steps over the batch x prompt-length cells of ``--fit-cells``, each
   split by the run's timeline into dense, attention and the rest
   (:class:`~lamina.costmodel.calibration.StagePoint`); fitted by
   :func:`lamina.costmodel.calibration.fit` and saved to ``configs/calibration/<kind>.yaml``.
3. **Check set**: decode tokens/s and TBT over ``--batches`` x ``--contexts``, measured with
   :func:`lamina.benchmark.measure.run_grid_cell` (``lamina bench``'s own grid measurement);
   the planner's predictions for the same cells are compared, and the table is printed and
   written to ``bench/results/calibration_<kind>.{json,md}``.

Steps 1-3 repeat ``--rounds`` times (default 3), each round on a fresh deployment that measures
its fit and check cells alternately, so both sets see the same machine (on this VM two
deployments, or one a few minutes apart, differ by up to ~40 % at batch 1; recording the
timeline itself costs nothing measurable). Every probe, stage time and check measurement is
then the median over rounds (the table gives the check cells' spread).

Exit status 0 when every check cell is within 25 % on tokens/s and TBT, 1 otherwise (the
table says which), 2 for bad arguments. Nothing here asserts speed: the errors are reported.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch

from lamina.benchmark.measure import _params, run_grid_cell
from lamina.benchmark.workloads import GridCell, grid
from lamina.costmodel.calibration import (CONFIG_DIR, TOLERANCE, Calibration, StagePoint,
                                          cpu_name, device_kind, error_rows, fit, with_dtype)

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"
_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def _on_cores(cores, fn):
    """Run ``fn()`` pinned to ``cores`` (None: as is) with that many torch threads."""
    saved, threads = os.sched_getaffinity(0), torch.get_num_threads()
    try:
        if cores:
            os.sched_setaffinity(0, set(cores))
            torch.set_num_threads(len(cores))
        return fn()
    finally:
        os.sched_setaffinity(0, saved)
        torch.set_num_threads(threads)


def _best(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def peak_flops(dtype: torch.dtype, device: str = "cpu", n: int = 2048) -> float:
    """FLOP/s of an ``n^3`` matmul (best of 5)."""
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    return 2 * n ** 3 / _best(lambda: (torch.mm(a, b), sync()), 5)


def copy_bandwidth(device: str = "cpu", mib: int = 256) -> float:
    """(read + write) bytes/s of one ``copy_`` of ``mib`` MiB (best of 5)."""
    src = torch.ones(mib << 18, device=device)
    dst = torch.empty_like(src)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    return 2 * src.numel() * 4 / _best(lambda: (dst.copy_(src), sync()), 5)


def stage_point(llm, cell: GridCell) -> StagePoint:
    """Decode steps of ``cell`` on ``llm`` (which records a timeline): every step after the one
    that finishes the last prefill, split into dense, attention and the rest."""
    engine = llm.deployment
    vocab = llm.deployment.instances[0].engine.vocab_size or 2
    reqs = [engine.add_request(list(r.prompt_ids), _params(r.output_len)) for r in cell.requests(vocab)]
    start = None
    steps = 0
    while engine.has_work():
        out = engine.step()
        if start is not None:
            steps += 1
        elif len(out.new_tokens) == cell.batch:
            start = time.perf_counter_ns()
    end = time.perf_counter_ns()
    for r in reqs:
        engine.forget(r.req_id)
        if r.error is not None:
            raise RuntimeError(f"calibration request failed: {r.error}")
    if start is None or steps == 0:
        raise RuntimeError(f"no full decode step in {cell}")
    tracks = llm.timeline.stage_seconds(start, end)
    llm.timeline.spans.clear()
    dense = sum(t.get("dense", 0.0) for t in tracks if t["role"].startswith("compute"))
    attention = max((t.get("attention", 0.0) for t in tracks if t["role"].startswith("memory")), default=0.0)
    # the first measured step reads context + 1 tokens, the last context + new_tokens - 1
    return StagePoint(cell.batch, cell.context + cell.new_tokens / 2, steps, (end - start) / 1e9 / steps,
                      dense / steps, attention / steps)


def _llm(args):
    """The measured deployment (module docstring), recording a timeline."""
    from lamina.llm import LLM

    return LLM(args.model, memory=1, placement="procs", device=args.device, dtype=args.dtype,
               kv_cache_gb=args.kv_cache_gb, max_num_seqs=max(args.batches + [b for b, _ in args.fit_cells]),
               max_num_batched_tokens=max(args.max_prompt_tokens, *(b * c for b, c in args.fit_cells)),
               trace=os.devnull)


def _spec(args):
    from lamina.costmodel.plan_cli import resolve_model

    return with_dtype(resolve_model(args.model), _BYTES[args.dtype])


def _simd() -> str:
    try:
        from lamina.kernels import cpp_ext

        feats = cpp_ext.load().simd_features().split()
        return next((f for f in ("avx512", "avx2", "generic") if f in feats), "")
    except Exception:  # noqa: BLE001 - the kind name only; the kernel reports its own failures
        return ""


def markdown(cal: Calibration, layers: int, rows: list[dict], command: str) -> str:
    lines = [f"# Cost-model calibration: {cal.kind}", "",
             f"Machine: {cal.machine}. Model {cal.model}, {cal.dtype_bytes}-byte dtype. Command: `{command}`.",
             "", f"Fitted (from the fit set's stage times, medians over {rows[0].get('rounds', 1) if rows else 1} "
             "rounds; fit and check cells alternate on each round's deployment):", "",
             f"- dense slices: peak {cal.peak_flops / 1e9:.1f} GFLOP/s (matmul probe), MFU(B) = "
             f"{cal.mfu_max:.3f} * B / (B + {cal.b_half:.2f})",
             f"- attention: {cal.bw_efficiency * cal.copy_bw / 1e9:.2f} GB/s of KV = "
             f"{cal.bw_efficiency:.2f} x copy bandwidth {cal.copy_bw / 1e9:.2f} GB/s",
             f"- fixed per step: {2e3 * cal.latency * layers:.2f} ms "
             f"(= 2 x layers x {cal.latency * 1e6:.1f} us); transfer {cal.net_bw / 1e9:.3g} GB/s", "",
             "Check set: `lamina bench` grid cells (decode only) vs the planner's prediction:", "",
             "| batch | context | measured tok/s | over rounds | predicted | error | measured TBT ms | predicted | error |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        spread = f"{r['tok_s_min']:.1f}-{r['tok_s_max']:.1f}" if "tok_s_min" in r else "-"
        lines.append(f"| {r['batch']} | {r['context']} | {r['tok_s']:.1f} | {spread} | {r['pred_tok_s']:.1f} | "
                     f"{100 * r['tok_err']:+.1f}% | {1e3 * r['tbt_s']:.1f} | {1e3 * r['pred_tbt_s']:.1f} | "
                     f"{100 * r['tbt_err']:+.1f}% |")
    worst = max((max(abs(r["tok_err"]), abs(r["tbt_err"])) for r in rows), default=0.0)
    lines += ["", f"Largest error {100 * worst:.1f}% (target: within {100 * TOLERANCE:.0f}%).", ""]
    return "\n".join(lines)


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dtype", default="float32", choices=sorted(_BYTES))
    ap.add_argument("--device", default="cpu", help="compute replica device (memory node: other cores)")
    ap.add_argument("--kv-cache-gb", type=float, default=3.0)
    ap.add_argument("--new-tokens", type=int, default=16, help="tokens decoded per request and cell")
    ap.add_argument("--rounds", type=int, default=3,
                    help="fit and check sets measured this many times, interleaved; medians used")
    ap.add_argument("--fit-cells", type=_cell, nargs="+", metavar="BxC",
                    default=[_cell(x) for x in ("1x32", "4x32", "16x32", "32x32", "2x1024", "4x2048")],
                    help="fit set: batch x prompt length cells")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32], help="check grid batch sizes")
    ap.add_argument("--contexts", type=int, nargs="+", default=[128, 512, 2048], help="check grid prompt lengths")
    ap.add_argument("--max-prompt-tokens", type=int, default=16384,
                    help="skip check cells whose batch x prompt length is larger (prefill time)")
    ap.add_argument("--out", default=str(CONFIG_DIR), help="folder for <kind>.yaml")
    ap.add_argument("--results", default=str(RESULTS), help="folder for calibration_<kind>.{json,md}")


def _cell(text: str) -> tuple[int, int]:
    try:
        b, c = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"cell {text!r}: expected BATCHxCONTEXT, e.g. 4x1024") from None
    return b, c


def _median_point(points: list[StagePoint]) -> StagePoint:
    """One StagePoint of a cell measured in several rounds: median stage times."""
    med = statistics.median
    p = points[0]
    return StagePoint(p.batch, p.kv_len, sum(x.steps for x in points), med([x.tbt for x in points]),
                      med([x.dense for x in points]), med([x.attention for x in points]))


def _median_check(rows: list[dict]) -> dict:
    """One check row of a cell measured in several rounds: median TBT (tokens/s follows as
    ``batch / TBT`` of the same round) and the spread of tokens/s over rounds."""
    mid = sorted(rows, key=lambda r: r["tbt_s"])[(len(rows) - 1) // 2]
    return {**mid, "tok_s_min": min(r["tok_s"] for r in rows), "tok_s_max": max(r["tok_s"] for r in rows),
            "rounds": len(rows)}


def _measure(args: argparse.Namespace, model, fit_cells: list[GridCell],
             check_cells: list[GridCell]) -> tuple[Calibration, list[dict]]:
    """``args.rounds`` rounds, each on a fresh deployment: probes, then the fit and check cells
    alternately (fit cells split by the timeline, check cells measured by ``lamina bench``'s
    :func:`run_grid_cell`). Returns the fit of the median stage points and the median check
    rows."""
    from tqdm.auto import tqdm

    dtype = getattr(torch, args.dtype)
    cap = int(args.kv_cache_gb * 2**30 // model.kv_bytes_per_token)
    dev = "cuda" if args.device.startswith("cuda") else "cpu"
    points: dict[int, list[StagePoint]] = {}
    checks: dict[int, list[dict]] = {}
    flops, bws = [], []
    order = [("fit", i) for i in range(len(fit_cells))] + [("check", i) for i in range(len(check_cells))]
    order.sort(key=lambda x: x[1] / (len(fit_cells) if x[0] == "fit" else len(check_cells)))
    for r in range(args.rounds):
        with _llm(args) as llm:
            comp, mem = llm.config.instance.role_devices()
            flops.append(_on_cores(comp[0].cores, lambda: peak_flops(dtype, args.device if dev == "cuda" else "cpu")))
            bws.append(_on_cores(mem[0].cores, copy_bandwidth))
            llm.generate([[5] * 8], use_tqdm=False)  # warm-up
            for which, i in tqdm(order, desc=f"round {r + 1}/{args.rounds}", unit="cell"):
                llm.timeline.spans.clear()
                if which == "fit":
                    if fit_cells[i].kv_tokens <= cap:
                        points.setdefault(i, []).append(stage_point(llm, fit_cells[i]))
                    continue
                cell = check_cells[i]
                g = run_grid_cell(llm, cell, "lamina", cap)
                if g.fits:
                    checks.setdefault(i, []).append(
                        {"batch": cell.batch, "context": cell.context, "kv_len": cell.context + cell.new_tokens / 2,
                         "tbt_s": g.token_latency_s, "tok_s": g.throughput})
    kind = device_kind(_simd()) if dev == "cpu" else gpu_kind(args.device)
    cal = fit(model, [_median_point(points[i]) for i in sorted(points)], kind=kind, machine=_machine(),
              peak_flops=statistics.median(flops), copy_bw=statistics.median(bws),
              memory_gb=os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9)
    return cal, [_median_check(checks[i]) for i in sorted(checks)]


def gpu_kind(device: str) -> str:
    """``gpu-<device name words>``, e.g. ``gpu-nvidia-h100-80gb-hbm3``."""
    import re

    words = re.split(r"[^a-z0-9]+", torch.cuda.get_device_name(torch.device(device)).lower())
    return "-".join(["gpu", *[w for w in words if w]])


def run(args: argparse.Namespace) -> int:
    try:
        if args.rounds < 1:
            raise ValueError(f"--rounds must be >= 1, got {args.rounds}")
        model = _spec(args)
        fit_cells = [c for b, ctx in args.fit_cells for c in grid([b], [ctx], args.new_tokens)]
        check_cells = [c for c in grid(args.batches, args.contexts, args.new_tokens)
                       if c.batch * c.context <= args.max_prompt_tokens]
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from lamina.models import ModelLoadError

    try:
        cal, measured = _measure(args, model, fit_cells, check_cells)
    except (ValueError, ModelLoadError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    rows = error_rows(cal, model, measured)
    cal.validation = rows
    path = cal.save(args.out)
    md = markdown(cal, model.layers, rows, getattr(args, "command", "lamina plan --calibrate"))
    res = Path(args.results)
    res.mkdir(parents=True, exist_ok=True)
    (res / f"calibration_{cal.kind}.json").write_text(json.dumps(cal.to_dict(), indent=1))
    (res / f"calibration_{cal.kind}.md").write_text(md)
    print(md)
    print(f"wrote {path}, {res / f'calibration_{cal.kind}.md'}")
    ok = all(abs(r["tok_err"]) <= TOLERANCE and abs(r["tbt_err"]) <= TOLERANCE for r in rows)
    return 0 if ok and rows else 1


def _machine() -> str:
    return f"{cpu_name()}, {len(os.sched_getaffinity(0))} cores, torch {torch.__version__}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="lamina plan --calibrate", description=__doc__.split("\n\n")[0])
    add_arguments(ap)
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        args = ap.parse_args(argv)
    except SystemExit as e:
        return int(e.code or 0)
    args.command = shlex.join(["lamina", "plan", "--calibrate", *argv])
    return run(args)


if __name__ == "__main__":
    raise SystemExit(main())
