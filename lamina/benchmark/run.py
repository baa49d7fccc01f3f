"""``lamina bench``: measure a deployment against its baselines and write a report.

    lamina bench --model smollm2 --compute 1 --memory 2 --workload mixed --report DIR
    lamina bench --plan --model llama-13b --budget 100000      # cost model only (planner)

Systems measured in the same run, on the same requests:

* ``lamina``: ``--instances`` of ``--compute`` replica(s) and ``--memory`` memory nodes placed by
  ``--placement`` (default procs), each node holding ``--kv-cache-gb`` of KV;
* ``homogeneous``: one memory node in this process on the compute device with the KV budget
  the compute node would have alone (``--compute-kv-gb``, default one node's budget);
* ``hf``: Hugging Face ``generate`` on the same weights.

A trace workload (short | long | mixed, see :mod:`lamina.benchmark.workloads`) is replayed with its
Poisson arrivals; the batch x context grid (``--batches`` x ``--contexts``) is measured for
every workload (``--workload grid`` runs the grid alone). The report folder gets
``report.md``, ``results.json`` and PNG plots (:mod:`lamina.benchmark.report`).
"""
from __future__ import annotations

import argparse
import os
import platform
import shlex
import sys
import time

import torch
from tqdm.auto import tqdm

from lamina.benchmark.workloads import TRACE_KINDS
from lamina.cli_args import add_deployment_args, config_from_args
from lamina.costmodel.constraints import Constraints, parse_bandwidth, parse_duration

COST_CONTEXTS = [1024, 2048, 4096, 8192, 16384, 32768]


def add_parser(sub) -> None:
    b = sub.add_parser("bench", help="benchmark a deployment against HF and homogeneous baselines",
                       description=__doc__.split("\n\n")[0])
    b.add_argument("--plan", action="store_true",
                   help="only print the recommended deployment for --budget (see `lamina bench --plan --help`)")
    b.add_argument("--workload", default="mixed", choices=[*TRACE_KINDS, "grid"])
    b.add_argument("--report", required=True, metavar="DIR", help="folder for report.md, results.json, PNGs")
    # the defaults are sized for the builtin model on a small CPU (a few minutes in all); on
    # real hardware raise --requests and --scale (1: the workloads' published lengths)
    b.add_argument("--requests", type=int, default=16, help="requests in the trace")
    b.add_argument("--rate", type=float, default=4.0, help="Poisson arrivals per second (inf: all at once)")
    b.add_argument("--scale", type=float, default=0.25, help="multiply trace lengths (1: as published)")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--batches", type=int, nargs="*", default=[1, 8, 32], help="grid batch sizes (none: no grid)")
    b.add_argument("--contexts", type=int, nargs="+", default=[128, 512], help="grid prompt lengths")
    b.add_argument("--new-tokens", type=int, default=16, help="tokens decoded per grid request")
    b.add_argument("--baselines", nargs="*", default=["hf", "homogeneous"], choices=["hf", "homogeneous"])
    b.add_argument("--compute-kv-gb", type=float, default=None,
                   help="KV budget of the homogeneous baseline (default: --kv-cache-gb)")
    b.add_argument("--trace", metavar="FILE.json", default=None,
                   help="write a Chrome/Perfetto timeline of the Lamina system's run")
    g = b.add_argument_group("cost report (the planner, as `lamina plan`; no weights involved)")
    g.add_argument("--plan-model", help="model to plan for (default: --model)")
    g.add_argument("--plan-context", type=int, default=4096, help="context of the top-plans table")
    g.add_argument("--cost-contexts", type=int, nargs="+", default=COST_CONTEXTS,
                   help="contexts of the throughput-per-$ curve")
    g.add_argument("--max-devices", type=int, default=64, help="compute + memory devices per plan")
    g.add_argument("--devices-per-node", type=int, default=8)
    g.add_argument("--tbt-slo", type=parse_duration, help="time between tokens, e.g. 100ms")
    g.add_argument("--nic", type=parse_bandwidth, help="network per device, e.g. 200Gbps")
    g.add_argument("--top", type=int, default=5, help="plans in the table")
    add_deployment_args(b, placement="procs", memory=2)
    b.set_defaults(func=cmd_bench)


def _check(args: argparse.Namespace) -> None:
    if args.memory < 1 or args.requests < 1 or args.new_tokens < 2 or not args.rate > 0 \
            or not args.scale > 0 or args.kv_cache_gb <= 0 or (args.compute_kv_gb or 1) <= 0:
        raise ValueError("--memory, --requests, --rate, --scale and KV budgets must be positive; "
                         "--new-tokens >= 2")
    if args.workload == "grid" and not args.batches:
        raise ValueError("--workload grid needs --batches")


def _machine(device: str) -> str:
    if device.startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}"


def cmd_bench(args: argparse.Namespace) -> int:
    from lamina.costmodel.hardware import load_catalog
    from lamina.costmodel.plan_cli import resolve_model
    from lamina.models import ModelLoadError
    from lamina.benchmark.report import BenchReport, cost_curves, markdown, top_plans, write_report
    from lamina.benchmark.workloads import grid

    try:
        _check(args)
        cells = grid(args.batches, args.contexts, args.new_tokens) if args.batches else []
        limits = Constraints(max_devices=args.max_devices, devices_per_node=args.devices_per_node,
                             nic_bw=args.nic, tbt_slo=args.tbt_slo)
        lamina_cfg = config_from_args(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    systems = [("lamina", dict(config=lamina_cfg, trace=args.trace))]
    if "homogeneous" in args.baselines:
        systems.append(("homogeneous", dict(
            model=args.model, memory=1, placement="inproc", device=args.device,
            dtype=args.dtype, kv_cache_gb=args.compute_kv_gb or args.kv_cache_gb,
            max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens)))
    rep = BenchReport(config={**vars(args), "func": None, "machine": _machine(args.device),
                              "command": "lamina " + shlex.join(sys.argv[1:]),
                              "date": time.strftime("%Y-%m-%d %H:%M")})
    shared: dict = {"trace": [], "vocab": 2, "pad": 0}
    phases = tqdm(total=len(systems) + ("hf" in args.baselines), desc="bench", unit="system")
    for name, kw in systems:
        phases.set_postfix_str(name)
        try:
            _measure_system(rep, name, kw, args, cells, shared)
        except (ValueError, ModelLoadError) as e:
            if not rep.trace and not rep.grid:  # a setting or model that cannot run: a usage error
                print(f"error: {e}", file=sys.stderr)
                return 2
            _failed(rep, name, e)
        except Exception as e:  # noqa: BLE001 -- what the other systems measured is kept
            _failed(rep, name, e)
        phases.update(1)
    if "hf" in args.baselines:
        phases.set_postfix_str("hf")
        try:
            _measure_hf(rep, args, cells, shared)
        except Exception as e:  # noqa: BLE001
            _failed(rep, "hf", e)
        phases.update(1)
    phases.close()
    try:  # the cost report plans for the model's shapes in bf16, as `lamina plan` does
        spec = resolve_model(args.plan_model or args.model)
    except (ValueError, ImportError) as e:
        rep.plan_note = f"no cost report: {e}"
    else:
        catalog = load_catalog()
        rep.config["plan_summary"] = (
            f"{spec.name}, context {args.plan_context}, at most {args.max_devices} devices, "
            f"{args.devices_per_node} per node" + (f", TBT <= {args.tbt_slo * 1e3:g} ms" if args.tbt_slo else "")
            + (f", NIC {args.nic * 8 / 1e9:g} Gbit/s" if args.nic else ""))
        rep.plans, rep.plan_note = top_plans(spec, args.plan_context, limits, catalog, args.top)
        rep.cost = cost_curves(spec, args.cost_contexts, limits, catalog)
    paths = write_report(rep, args.report)
    print(markdown(rep))
    print("wrote " + ", ".join(str(p) for p in paths))
    return 1 if rep.failures else 0


def _failed(rep, system: str, e: BaseException) -> None:
    rep.failures[system] = f"{type(e).__name__}: {e}"
    print(f"error: {system}: {rep.failures[system]} (the report keeps what was measured)",
          file=sys.stderr)


def _measure_system(rep, name: str, kw: dict, args: argparse.Namespace, cells: list,
                    shared: dict) -> None:
    """Start system ``name`` as ``LLM(**kw)`` and measure it on the trace (drawn by the first
    system, then shared) and on every grid cell; a cell that fails is kept with its reason."""
    from lamina.llm import LLM
    from lamina.benchmark.measure import GridPoint, run_grid_cell, run_trace
    from lamina.benchmark.workloads import synthetic_trace

    with LLM(**kw) as llm:
        engines = [x.engine for x in llm.deployment.instances]
        eng = engines[0]
        shared["vocab"] = vocab = eng.vocab_size or 2
        cap = sum(e.scheduler.total_capacity for e in engines)
        shared["pad"] = getattr(llm.tokenizer, "pad_token_id", None) or 0
        if args.workload != "grid" and not shared["trace"]:
            shared["trace"] = synthetic_trace(args.workload, args.requests, args.rate, vocab,
                                              seed=args.seed, scale=args.scale,
                                              max_context=eng.scheduler.config.max_model_len)
        rep.capacity[name] = cap
        rep.fits[name] = {c: min(cap // (c + args.new_tokens), args.max_num_seqs) for c in args.contexts}
        llm.generate([[min(100, vocab - 1)] * 4], use_tqdm=False)  # warm-up: first-call costs
        if shared["trace"]:
            rep.trace.append(run_trace(llm, shared["trace"], name,
                                       parallel_nodes=llm.config.instance.placement != "inproc"))
        for cell in tqdm(cells, desc=f"{name} grid", unit="cell", leave=False):
            try:
                rep.grid.append(run_grid_cell(llm, cell, name, cap))
            except Exception as e:  # noqa: BLE001 -- the other cells go on
                rep.grid.append(GridPoint(name, cell.batch, cell.context, True,
                                          note=f"{type(e).__name__}: {e}"))


def _measure_hf(rep, args: argparse.Namespace, cells: list, shared: dict) -> None:
    """The Hugging Face ``generate`` baseline on the same trace and cells."""
    from lamina.benchmark.measure import hf_grid_cell, hf_trace
    from lamina.models import load_model

    model = load_model(args.model, device=args.device).model
    if shared["trace"]:
        rep.trace.insert(0, hf_trace(model, shared["trace"], shared["pad"], args.max_num_seqs))
    for cell in tqdm(cells, desc="hf grid", unit="cell", leave=False):
        rep.grid.append(hf_grid_cell(model, cell, shared["pad"], shared["vocab"]))

