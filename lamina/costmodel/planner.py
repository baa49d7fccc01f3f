"""Deployment planner: which compute and memory devices, how many, for a budget.

:func:`plan` searches every (compute device, memory device) pair of the catalog, and every
compute device alone (homogeneous), with device counts whose total price fits the budget,
using the decode cost model of :mod:`lamina.costmodel.model`. The best deployment is the one with
the highest throughput (tokens/s); ties go to the higher tokens/s/$. For a fixed number of
compute devices, throughput never falls when memory devices are added and stops rising once
:func:`~lamina.costmodel.model.device_ratio` is met, so the search buys
``min(affordable, needed)`` memory devices for every affordable compute count.

:func:`plan_main` is the command line (``lamina bench --plan``)::

    --model NAME_OR_HF_CONFIG --budget USD [--context N] [--hardware FILE ...]
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field, replace
from typing import Any, Iterable, Mapping

from lamina.costmodel.model import (DEFAULT, Assumptions, Estimate, Infeasible, ModelSpec, device_ratio,
                              homogeneous, load_model_spec, min_interconnect_bandwidth, offloaded,
                              tp_degree)
from lamina.costmodel.hardware import CatalogError, Device, get_device, load_catalog


class PlanError(ValueError):
    """No deployment within the budget can serve the workload."""


@dataclass(frozen=True)
class Plan:
    """Result of :func:`plan`. ``alternatives``: the best deployment of every other device
    combination, by throughput. ``baseline``: best homogeneous deployment (None if none fits)."""

    model: ModelSpec
    budget_usd: float
    context: int
    best: Estimate
    alternatives: list[Estimate] = field(default_factory=list)
    baseline: Estimate | None = None
    why: str = ""

    @property
    def bottleneck(self) -> str:
        return self.best.bottleneck


def as_model(model_cfg: Any) -> ModelSpec:
    """ModelSpec, preset name / config path (str), or HF config (dict or config object)."""
    if isinstance(model_cfg, ModelSpec):
        return model_cfg
    if isinstance(model_cfg, str):
        return load_model_spec(model_cfg)
    return ModelSpec.from_hf_config(model_cfg)


def _pick(catalog: Mapping[str, Device], names: Iterable[str] | None, role: str) -> list[Device]:
    if names is None:
        return [d for d in catalog.values() if d.can(role)]
    return [get_device(catalog, n) for n in names]


def _key(e: Estimate) -> tuple[float, float]:
    return (e.throughput, e.per_dollar)


def _best_for_pair(model: ModelSpec, comp: Device, mem: Device | None, budget: float, context: int,
                   a: Assumptions) -> Estimate | None:
    """Highest-throughput deployment of ``comp`` (+ ``mem``) costing at most ``budget``."""
    if mem is None:
        return best_homogeneous(model, comp, context, a, budget=budget)
    tp = tp_degree(model, comp, a)
    most = int(budget // (tp * comp.price_usd))  # affordable replicas
    best = None
    for replicas in range(1, most + 1):
        n = replicas * tp
        m_budget = int((budget - n * comp.price_usd + 1e-6) // mem.price_usd)
        if m_budget < 1:
            break
        if a.microbatches > 1:
            need = device_ratio(model, comp, mem, replicas * a.max_batch, context, n, a).n_memory
            m_budget = min(m_budget, need)
        try:
            est = offloaded(model, comp, mem, n, m_budget, context, a)
        except Infeasible:
            continue
        if best is None or _key(est) > _key(best):
            best = est
    return best


def best_homogeneous(model: ModelSpec, dev: Device, context: int, a: Assumptions = DEFAULT,
                     budget: float | None = None, max_tp: int = 8) -> Estimate | None:
    """Best homogeneous deployment over tensor-parallel sizes ``tp_degree..max_tp`` (a larger
    replica has more KV room). With ``budget``: as many replicas as it buys, ranked by
    throughput; without: one replica, ranked by tokens/s/$. None if nothing fits."""
    best = None
    for tp in range(tp_degree(model, dev, a), max_tp + 1):
        replicas = 1 if budget is None else int(budget // (tp * dev.price_usd))
        try:
            est = homogeneous(model, dev, replicas * tp, context, a, tp=tp)
        except Infeasible:
            continue
        key = _key(est) if budget is not None else (est.per_dollar, est.throughput)
        if best is None or key > best[0]:
            best = (key, est)
    return best[1] if best else None


def best_per_dollar(model: ModelSpec, compute: Device, memory: Device, context: int,
                    n_compute: int | None = None, a: Assumptions = DEFAULT, tp: int | None = None) -> Estimate:
    """Offloaded deployment with the highest tokens/s/$ for ``n_compute`` compute devices
    (default one replica) in replicas of ``tp`` (default :func:`tp_degree`), over
    memory-device counts up to the one that saturates them."""
    tp = tp or tp_degree(model, compute, a)
    n_compute = n_compute or tp
    batch = n_compute // tp * a.max_batch
    full = device_ratio(model, compute, memory, batch, context, n_compute, a, tp).n_memory
    best = None
    for m in range(1, full + 1):
        try:
            est = offloaded(model, compute, memory, n_compute, m, context, a, tp=tp)
        except Infeasible:
            continue
        if best is None or est.per_dollar > best.per_dollar:
            best = est
    if best is None:
        raise Infeasible(f"{context}-token requests do not fit {full} x {memory.name}")
    return best


def _why(model: ModelSpec, best: Estimate, baseline: Estimate | None, a: Assumptions) -> str:
    tp = tp_degree(model, best.compute, a)
    per_rep = best.batch / (best.n_compute // tp)
    parts = [f"{best.label()} decodes {best.batch} requests of {best.context} tokens per step "
             f"({per_rep:.0f} per replica of {tp} x {best.compute.name}); the pace is set by "
             f"{best.bottleneck}, the batch by {best.batch_limit}."]
    if best.memory is not None:
        kv = best.batch * best.context * model.kv_bytes_per_token / 1e9
        need = min_interconnect_bandwidth(model, best.compute, per_rep / a.microbatches, a.mfu, tp) / tp
        parts.append(f"KV cache {kv:.0f} GB on {best.n_memory} x {best.memory.name}; each compute "
                     f"device needs {need / 1e9:.1f} GB/s of network to hide transfers, "
                     f"its NIC gives {best.compute.nic_bw / 1e9:.0f} GB/s.")
    if baseline is not None and baseline is not best:
        parts.append(f"Best homogeneous option {baseline.label()}: {baseline.throughput:,.0f} tok/s, "
                     f"{baseline.per_dollar:.4f} tok/s/$; this plan gives "
                     f"{best.per_dollar / baseline.per_dollar:.2f}x the tokens/s/$.")
    elif baseline is None:
        parts.append("No homogeneous deployment fits this budget and context.")
    return " ".join(parts)


def plan(model_cfg: Any, budget_usd: float, context_len: int,
         catalog: Mapping[str, Device] | None = None, *, assumptions: Assumptions = DEFAULT,
         compute: Iterable[str] | None = None, memory: Iterable[str] | None = None,
         top: int = 5) -> Plan:
    """Best deployment of ``model_cfg`` for requests of ``context_len`` KV tokens whose device
    price sum is at most ``budget_usd``. ``catalog`` defaults to :func:`load_catalog`.
    Candidates are the devices named in ``compute`` / ``memory`` (case-insensitive), by
    default every catalog entry whose roles allow it (:meth:`Device.can`). Raises PlanError
    when nothing fits, KeyError for an unknown device name."""
    model = as_model(model_cfg)
    if budget_usd <= 0 or context_len < 1:
        raise ValueError(f"budget ({budget_usd}) and context ({context_len}) must be positive")
    catalog = load_catalog() if catalog is None else catalog
    a = assumptions
    comps = _pick(catalog, compute, "compute")
    mems = _pick(catalog, memory, "memory")
    found: list[Estimate] = []
    for comp in comps:
        for mem in [None, *mems]:
            est = _best_for_pair(model, comp, mem, budget_usd, context_len, a)
            if est is not None:
                found.append(est)
    if not found:
        raise PlanError(f"no deployment of {model.name} ({model.weight_bytes / 1e9:.1f} GB of weights) "
                        f"with {context_len}-token requests fits ${budget_usd:,.0f}")
    found.sort(key=_key, reverse=True)
    homo = [e for e in found if e.memory is None]
    baseline = homo[0] if homo else None
    best = found[0]
    return Plan(model, budget_usd, context_len, best, found[1:top + 1], baseline, _why(model, best, baseline, a))


def format_plan(p: Plan) -> str:
    """Human-readable recommendation plus a table of the top alternatives."""
    b = p.best
    lines = [f"Model {p.model.name}: {p.model.params / 1e9:.2f} B params, {p.model.weight_bytes / 1e9:.1f} GB "
             f"weights, {p.model.kv_bytes_per_token / 1e6:.3f} MB KV per token",
             f"Budget ${p.budget_usd:,.0f}, context {p.context} tokens",
             f"Recommended: {b.label()}  cost ${b.cost_usd:,.0f}  "
             f"{b.throughput:,.0f} tok/s  {b.per_dollar:.4f} tok/s/$  bottleneck: {b.bottleneck}",
             f"Why: {p.why}", ""]
    head = f"{'#':>2}  {'deployment':<38} {'cost $':>10} {'batch':>6} {'tok/s':>9} {'tok/s/$':>8}  bottleneck"
    lines += [head, "-" * len(head)]
    for i, e in enumerate([b, *p.alternatives], 1):
        lines.append(f"{i:>2}  {e.label():<38} {e.cost_usd:>10,.0f} {e.batch:>6} {e.throughput:>9,.0f} "
                     f"{e.per_dollar:>8.4f}  {e.bottleneck}")
    return "\n".join(lines)


def plan_main(argv: list[str] | None = None) -> int:
    """Command line: print the recommended deployment and the top alternatives. Returns 0, or
    2 with a message on stderr for bad arguments, catalogs, models or budgets."""
    ap = argparse.ArgumentParser(prog="lamina bench --plan", description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="smollm2, llama-13b, llama-33b, llama-65b or an HF config.json/folder")
    ap.add_argument("--budget", required=True, type=float, help="US dollars for all devices")
    ap.add_argument("--context", type=int, default=4096, help="average KV length per request (default 4096)")
    ap.add_argument("--hardware", action="append", default=[], metavar="FILE",
                    help="extra catalog YAML overriding/extending the builtin one (repeatable)")
    ap.add_argument("--max-batch", type=int, default=DEFAULT.max_batch, help="tokens per step per compute replica")
    ap.add_argument("--mfu", type=float, default=None, help="constant MFU instead of the default MFU(B) curve")
    ap.add_argument("--compute", action="append", metavar="NAME", help="only these compute devices")
    ap.add_argument("--memory", action="append", metavar="NAME", help="only these memory devices")
    ap.add_argument("--top", type=int, default=5, help="alternatives to list")
    try:
        args = ap.parse_args(argv)
    except SystemExit as e:  # --help or a usage error: argparse already printed
        return int(e.code or 0)
    a = replace(DEFAULT, max_batch=args.max_batch, **({"mfu": args.mfu} if args.mfu is not None else {}))
    try:
        p = plan(args.model, args.budget, args.context, load_catalog(args.hardware), assumptions=a,
                 compute=args.compute, memory=args.memory, top=args.top)
    except (CatalogError, ValueError, KeyError) as e:  # PlanError and Infeasible are ValueErrors
        print(f"error: {e.args[0] if isinstance(e, KeyError) else e}", file=sys.stderr)
        return 2
    print(format_plan(p))
    return 0


if __name__ == "__main__":
    raise SystemExit(plan_main())
