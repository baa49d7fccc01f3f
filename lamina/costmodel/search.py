"""Constrained deployment search behind ``lamina plan``: every shown plan obeys every limit.

For each compute device kind (catalog role ``compute``) paired with each memory device kind
(role ``memory``), and for the compute kind alone (homogeneous baseline), the search tries
replica counts, batch sizes (powers of two per replica, or the ``--batch`` given),
micro-batches (1: no overlap; 2: staggered, or rotational with several replicas) and memory
device counts from "just holds the KV" to "never the bottleneck", estimates each with
:func:`lamina.costmodel.model.offloaded` / :func:`~lamina.costmodel.model.homogeneous`, adds
nodes, network and latency (below), drops every candidate that breaks a constraint and keeps,
per device pair, the smallest of those within 2 % of the lowest USD per million tokens
(:func:`pick`).

Timing model, seconds. ``step`` is the cost model's step (max of dense, attention and
network times with >= 2 micro-batches, their sum with 1). A micro-batch's own iteration
cannot be shorter than its critical path: dense + attention + transfer of ``B/n`` tokens plus
one round trip per layer (``2 * L * nic_latency``) when memory devices sit on other nodes.
TBT = max(step, critical path); throughput = batch / TBT. TTFT = prefill of one prompt of
``context`` tokens alone on one replica (``2N`` FLOP per token at MFU(context)) + shipping its
KV to remote memory devices over one compute device's NIC + one latency; queueing and the
decode work a prefill displaces are not modelled.

Money: ``usd`` is the capex of the devices (catalog ``price_usd``; hosts, NICs, power and
operations excluded, as in Lamina Table 1 / Fig. 13). ``usd_per_mtok`` amortises it over
:data:`AMORTISATION_YEARS` years of decoding at the predicted throughput, 24/7:
``usd / (tok/s * 3 * 365 * 86400 / 1e6)``. Ranking by ``usd_per_mtok`` is ranking by tokens/s/$.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from lamina.costmodel.constraints import FLAGS, Constraints
from lamina.costmodel.hardware import Device
from lamina.costmodel.model import (DEFAULT, Assumptions, Estimate, Infeasible, ModelSpec, attn_time,
                                    device_ratio, homogeneous, mfu_at, nonattn_time, offloaded,
                                    tp_degree)

AMORTISATION_YEARS = 3.0
_SECONDS = AMORTISATION_YEARS * 365 * 86400
_NECK = {"compute": "compute", "weight bandwidth": "memory bandwidth",
         "attention": "memory bandwidth", "network": "interconnect"}


@dataclass(frozen=True)
class Candidate:
    """One priced, timed deployment. Times in seconds, bandwidths in bytes/s."""

    est: Estimate
    micro_batches: int
    nodes: int
    remote_memory: int  # memory devices outside the compute nodes
    tbt: float
    ttft: float
    net_used: float  # average bytes/s crossing the network
    net_available: float  # bytes/s the NICs give (inf: everything inside one node)
    bottleneck: str

    @property
    def homogeneous(self) -> bool:
        return self.est.memory is None

    @property
    def throughput(self) -> float:
        return self.est.batch / self.tbt

    @property
    def usd(self) -> float:
        return self.est.cost_usd

    @property
    def usd_per_mtok(self) -> float:
        return self.usd / (self.throughput * _SECONDS / 1e6)

    @property
    def n_devices(self) -> int:
        return self.est.n_compute + self.est.n_memory

    tp: int = 1  # devices per compute replica (tensor parallel)

    @property
    def pipeline(self) -> str:
        """none (1 micro-batch), staggered (2 on one replica), rotational (several replicas)."""
        if self.micro_batches == 1:
            return "none"
        return "rotational" if self.est.n_compute // self.tp > 1 else "staggered"

    def devices(self) -> dict[str, int]:
        d = {self.est.compute.name: self.est.n_compute}
        if self.est.memory is not None:
            d[self.est.memory.name] = d.get(self.est.memory.name, 0) + self.est.n_memory
        return d

    def rank_key(self) -> tuple[float, int, float]:
        """Cheapest per token, then fewer devices, then more tokens/s."""
        return (self.usd_per_mtok, self.n_devices, -self.throughput)


TIE = 0.02  # plans within 2 % of the cheapest $/Mtok count as equally cheap


def pick(cands: list[Candidate]) -> Candidate:
    """The smallest deployment (fewest devices, then more tokens/s) among those within
    :data:`TIE` of the lowest $/Mtok: a buyer replicates a small unit rather than order a
    huge one for a 1 % saving."""
    floor = min(c.usd_per_mtok for c in cands)
    return min((c for c in cands if c.usd_per_mtok <= floor * (1 + TIE)),
               key=lambda c: (c.n_devices, -c.throughput))


@dataclass
class Outcome:
    """``plans``: best feasible candidate per device pair, best first. ``baseline``: best
    feasible homogeneous plan (also in ``plans``) or None. ``near_misses``: constraint ->
    (candidates breaking only it, best value reached) for the "nothing fits" message."""

    plans: list[Candidate] = field(default_factory=list)
    baseline: Candidate | None = None
    near_misses: dict[str, list] = field(default_factory=dict)


def _layout(n_c: int, mem: Device | None, n_m: int, per_node: int) -> tuple[int, int, int]:
    """(compute nodes, memory-only nodes, remote memory devices)."""
    c_nodes = math.ceil(n_c / per_node)
    if mem is None or n_m == 0:
        return c_nodes, 0, 0
    if mem.kind == "cpu":  # a CPU memory host is its own server
        return c_nodes, n_m, n_m
    local = min(n_m, c_nodes * per_node - n_c)
    return c_nodes, math.ceil((n_m - local) / per_node), n_m - local


def _nic(dev: Device, c: Constraints) -> float:
    return c.nic_bw if c.nic_bw is not None else dev.nic_bw


def evaluate(model: ModelSpec, est: Estimate, mb: int, c: Constraints, a: Assumptions,
             tp: int) -> tuple[Candidate, dict[str, float]]:
    """Time, price and check one estimate. Returns the candidate and the constraints it
    breaks (name -> the value that broke it)."""
    comp, mem, n_c, n_m = est.compute, est.memory, est.n_compute, est.n_memory
    c_nodes, m_nodes, remote = _layout(n_c, mem, n_m, c.devices_per_node)
    b, L = est.batch, model.layers
    remote_bytes = b * model.transfer_bytes_per_token * (remote / n_m if n_m else 0.0)
    if remote:
        side_c = (c_nodes if c.nic_shared else n_c) * _nic(comp, c)
        side_m = (m_nodes if c.nic_shared else remote) * _nic(mem, c)
        avail = min(side_c, side_m)
    else:
        avail = math.inf
    t_net = remote_bytes / avail if remote else 0.0
    lat = 2 * L * c.nic_latency if remote else 0.0
    replicas = n_c // tp
    if mem is None:
        step, times = est.step_time, {est.bottleneck: est.step_time}
        crit = step
    else:
        times = {"compute": est.t_compute, "attention": est.t_attention, "network": t_net}
        step = sum(times.values()) if mb == 1 else max(times.values())
        per = b / replicas / mb
        crit = (nonattn_time(model, comp, per, a.mfu, tp)
                + attn_time(model, mem, per * replicas, est.context, n_m, a.bw_efficiency) / replicas
                + t_net / replicas / mb + lat)
    tbt = max(step, crit)
    if crit > step and lat > crit / 2:
        neck = "interconnect"
    else:
        k = max(times, key=times.get)
        neck = est.bottleneck if k == "compute" and mem is not None else k
        neck = _NECK.get(neck, neck)
    if mem is None and est.batch_limit == "KV capacity":
        neck = "KV capacity"
    prompt = est.context
    ttft = prompt * model.flops_per_token / (tp * comp.flops * mfu_at(a.mfu, prompt))
    if remote:
        ttft += prompt * model.kv_bytes_per_token * (remote / n_m) / _nic(comp, c) + c.nic_latency
    cand = Candidate(est, mb, c_nodes + m_nodes, remote, tbt, ttft, remote_bytes / tbt, avail, neck, tp)
    broken: dict[str, float] = {}
    if c.max_devices is not None and cand.n_devices > c.max_devices:
        broken["max_devices"] = cand.n_devices
    if tp > c.devices_per_node:
        broken["devices_per_node"] = tp
    if c.nodes is not None and cand.nodes > c.nodes:
        broken["nodes"] = cand.nodes
    if c.tbt_slo is not None and tbt > c.tbt_slo * (1 + 1e-9):
        broken["tbt_slo"] = tbt
    if c.ttft_slo is not None and ttft > c.ttft_slo * (1 + 1e-9):
        broken["ttft_slo"] = ttft
    if c.budget_usd is not None and cand.usd > c.budget_usd + 1e-6:
        broken["budget_usd"] = cand.usd
    return cand, broken


def _batches(c: Constraints, replicas: int, a: Assumptions) -> list[int]:
    if c.batch is not None:
        return [c.batch] if c.batch >= replicas else []
    out, b = [], 1
    while b <= a.max_batch:
        out.append(b * replicas)
        b *= 2
    return out


def _counts(lo: int, hi: int) -> list[int]:
    """lo, hi and a few geometric steps between."""
    out, x = {lo, hi}, float(lo)
    while x < hi:
        out.add(int(round(x)))
        x *= 1.5
    return sorted(v for v in out if lo <= v <= hi)


def _replica_counts(limit: int) -> list[int]:
    return [r for r in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128) if r <= limit]


def search(model: ModelSpec, computes: list[Device], memories: list[Device], context: int,
           c: Constraints, a: Assumptions = DEFAULT) -> Outcome:
    """Best feasible plan per (compute, memory) pair and per compute device alone."""
    out = Outcome()
    feasible: dict[tuple[str, str], list[Candidate]] = {}
    slo_free: dict[tuple[str, str], list[Candidate]] = {}  # breaking only the TBT target
    cap_devices = c.max_devices or 256
    misses: dict[str, list] = {}

    def consider(cand: Candidate, broken: dict[str, float]) -> None:
        key = (cand.est.compute.name, cand.est.memory.name if cand.est.memory else "")
        if not broken:
            feasible.setdefault(key, []).append(cand)
        if set(broken) == {"tbt_slo"}:
            slo_free.setdefault(key, []).append(cand)
        if len(broken) == 1:
            (name, value), = broken.items()
            slot = misses.setdefault(name, [0, value])
            slot[0] += 1
            slot[1] = min(slot[1], value)

    for comp in computes:
        try:
            tp = tp_degree(model, comp, a)
        except Infeasible:
            continue
        for r in _replica_counts(max(1, cap_devices // tp)):
            n_c = r * tp
            for mb in (1, 2):
                for b in _batches(c, r, a):
                    if mb > b // r:
                        continue
                    am = Assumptions(a.mfu, a.max_batch, a.usable_memory, mb, a.bw_efficiency)
                    for mem in memories:
                        per_dev = a.usable_memory * mem.memory_bytes
                        m_cap = max(1, math.ceil(b * context * model.kv_bytes_per_token / per_dev - 1e-9))
                        m_full = max(m_cap, device_ratio(model, comp, mem, b, context, n_c, am).n_memory)
                        m_full = min(m_full, max(m_cap, 4 * cap_devices))
                        for m in _counts(m_cap, m_full):
                            try:
                                est = offloaded(model, comp, mem, n_c, m, context, am, batch=b)
                            except Infeasible:
                                continue
                            consider(*evaluate(model, est, mb, c, am, tp))
                # homogeneous: weights and KV on the compute devices, times add
                for tp_h in range(tp, min(8, c.devices_per_node) + 1):
                    if mb > 1 or (r * tp_h) > 4 * cap_devices:
                        break
                    if c.batch is not None and c.batch % r:
                        continue
                    try:
                        est = homogeneous(model, comp, r * tp_h, context, a,
                                          batch=None if c.batch is None else c.batch // r, tp=tp_h)
                    except Infeasible:
                        misses.setdefault("kv_capacity", [0, 0])[0] += 1
                        continue
                    consider(*evaluate(model, est, 1, c, a, tp_h))
            # homogeneous batches below the KV-capacity maximum (to meet a TBT target)
            if c.tbt_slo is not None and c.batch is None:
                for tp_h in range(tp, min(8, c.devices_per_node) + 1):
                    for b in _batches(c, 1, a):
                        try:
                            est = homogeneous(model, comp, r * tp_h, context, a, batch=b, tp=tp_h)
                        except Infeasible:
                            break
                        consider(*evaluate(model, est, 1, c, a, tp_h))
    best = {key: pick(cands) for key, cands in feasible.items()}
    for key, cand in best.items():  # a looser TBT target would have bought a cheaper plan
        if key in slo_free and pick(slo_free[key]).usd_per_mtok < cand.usd_per_mtok / (1 + TIE):
            best[key] = replace(cand, bottleneck="latency target")
    out.plans = sorted(best.values(), key=Candidate.rank_key)
    homo = [p for p in out.plans if p.homogeneous]
    out.baseline = homo[0] if homo else None
    out.near_misses = misses
    return out


def binding_message(out: Outcome, c: Constraints) -> str:
    """Why nothing fits: the constraint(s) whose removal alone would admit a plan."""
    fmt = {"tbt_slo": lambda v: f"fastest TBT reachable is {v * 1e3:.1f} ms > {c.tbt_slo * 1e3:g} ms",
           "ttft_slo": lambda v: f"fastest TTFT reachable is {v * 1e3:.0f} ms > {c.ttft_slo * 1e3:g} ms",
           "max_devices": lambda v: f"the smallest plan needs {v:.0f} devices > {c.max_devices}",
           "nodes": lambda v: f"the smallest plan needs {v:.0f} nodes > {c.nodes}",
           "budget_usd": lambda v: f"the cheapest plan costs ${v:,.0f} > ${c.budget_usd:,.0f}",
           "devices_per_node": lambda v: f"the weights need {v:.0f} devices per node > {c.devices_per_node}",
           "kv_capacity": lambda v: "the KV cache does not fit"}
    if not out.near_misses:
        return ("no plan meets the constraints; no single relaxation helps (several limits bind "
                "together, or the model does not fit the catalog's devices)")
    order = sorted(out.near_misses.items(), key=lambda kv: -kv[1][0])
    reasons = [f"{FLAGS[k]} ({fmt[k](v)})" for k, (n, v) in order if k != "kv_capacity"]
    if not reasons:
        reasons = ["KV capacity (the KV cache of batch x context does not fit any deployment)"]
    return "no plan meets all constraints; binding: " + "; ".join(reasons)
