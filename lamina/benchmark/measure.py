"""Measurements behind ``lamina bench``: drive an engine through a workload and time it.

:func:`run_trace` replays a trace of :class:`~lamina.benchmark.workloads.TraceRequest` against an
:class:`~lamina.llm.LLM`'s engine in this thread: each request is added when the wall clock
passes its arrival time, the engine steps while it has work, and every sampled token is
time-stamped. It returns a :class:`RunResult`: output throughput, TTFT (arrival to first
token) and TBT (gaps between a request's tokens) percentiles, the largest batch seen, and a
per-component breakdown of the wall time (Lamina Fig. 14):

* ``compute``: the replica's own work (slices and sampling), from :class:`~lamina.engine.worker.WorkerTimes`;
* ``attention``: memory-node ATTEND time from STATS ``attend_us``, summed over nodes that run in
  this process (they run one after another) or the busiest node when they are processes
  (they run side by side);
* ``network``: time the replica waited on memory nodes beyond their attention time
  (encode, copy, wake-up);
* ``idle``: the rest of the wall time (scheduling, waiting for arrivals).

:func:`run_grid_cell` measures decode throughput of one batch x context cell;
:func:`hf_grid_cell` and :func:`hf_trace` are the Hugging Face ``generate`` baselines.
"""
from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field

import torch
from tqdm.auto import tqdm

from lamina.types import SamplingParams
from lamina.benchmark.workloads import GridCell, TraceRequest


@dataclass
class Breakdown:
    """Seconds of a run's wall time by component (see the module docstring)."""

    compute_s: float = 0.0
    attention_s: float = 0.0
    network_s: float = 0.0
    idle_s: float = 0.0


@dataclass
class RunResult:
    """One system on one trace. Latencies in seconds; ``throughput``: output tokens/s over the
    run's wall time (first arrival to last token)."""

    system: str
    num_requests: int
    completed: int
    errors: list[str]
    output_tokens: int
    prompt_tokens: int
    wall_s: float
    throughput: float
    ttft_p50: float
    ttft_p99: float
    tbt_p50: float
    tbt_p99: float
    max_batch: int  # most requests decoding in one step
    breakdown: Breakdown = field(default_factory=Breakdown)
    cached_tokens: int = 0  # prompt tokens found in the prefix cache (not computed)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class GridPoint:
    """Decode throughput of ``batch`` requests at ``context`` prompt tokens. ``fits`` is False
    (and the timings NaN) when the cell needs more KV than the system holds; ``note`` says why
    a cell that fits was not measured (timings NaN then too)."""

    system: str
    batch: int
    context: int
    fits: bool
    throughput: float = math.nan  # decode tokens/s
    token_latency_s: float = math.nan  # time between two tokens of one request
    note: str = ""

    def to_dict(self) -> dict:
        return asdict(self)


def percentile(xs: list[float], q: float) -> float:
    """``q``-th percentile (0..100, linear interpolation); NaN for no samples."""
    if not xs:
        return math.nan
    return float(torch.quantile(torch.tensor(xs, dtype=torch.float64), q / 100))


def _params(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def _engines(llm) -> list:
    return [x.engine for x in llm.deployment.instances]


def _attend_s(llm) -> list[float]:
    return [s.attend_us / 1e6 for e in _engines(llm) for s in e.worker.stats()]


def _times(llm) -> tuple[float, float]:
    """(execute, wait) seconds summed over instances: the engine's time in its workers and
    the part blocked on memory nodes (or, replicas out of process, on the replicas)."""
    times = [e.worker.times() for e in _engines(llm)]
    return sum(t.execute_s for t in times), sum(t.wait_s for t in times)


def run_trace(llm, trace: list[TraceRequest], system: str, *, parallel_nodes: bool,
              progress: bool = True) -> RunResult:
    """Replay ``trace`` (sorted by arrival) on ``llm``'s engine; see the module docstring.
    ``parallel_nodes``: the memory nodes are separate processes (attention overlaps across
    them). Requests the engine rejects or fails are counted in ``errors``, never retried."""
    engine = llm.deployment
    exec0, wait0 = _times(llm)
    attend0 = _attend_s(llm)
    hits0 = engine.prefix_stats()[1]
    arrival: dict[int, float] = {}
    stamps: dict[int, list[float]] = {}
    errors: list[str] = []
    max_batch = completed = 0
    bar = tqdm(total=len(trace), desc=system, unit="req", disable=not progress, leave=False)
    t0, i = time.perf_counter(), 0
    while i < len(trace) or engine.has_work():
        now = time.perf_counter() - t0
        while i < len(trace) and trace[i].arrival_s <= now:
            tr = trace[i]
            i += 1
            try:
                req = engine.add_request(list(tr.prompt_ids), _params(tr.output_len))
            except ValueError as e:
                errors.append(str(e))
                bar.update(1)
                continue
            arrival[req.req_id], stamps[req.req_id] = tr.arrival_s, []
        if not engine.has_work():
            time.sleep(max(0.0, min(trace[i].arrival_s - now, 0.05)))
            continue
        out = engine.step()
        t = time.perf_counter() - t0
        max_batch = max(max_batch, len(out.new_tokens))
        for rid in out.new_tokens:
            stamps[rid].append(t)
        for req in out.finished:
            bar.update(1)
            if req.error is not None:
                errors.append(f"request {req.req_id}: {req.error}")
            else:
                completed += 1
            engine.forget(req.req_id)
    wall = time.perf_counter() - t0
    bar.close()
    exec1, wait1 = _times(llm)
    attend = [b - a for a, b in zip(attend0, _attend_s(llm))]
    attention = max(attend, default=0.0) if parallel_nodes else sum(attend)
    wait = wait1 - wait0
    bd = Breakdown(compute_s=(exec1 - exec0) - wait, attention_s=min(attention, wait),
                   network_s=max(0.0, wait - attention), idle_s=max(0.0, wall - (exec1 - exec0)))
    ttft = [s[0] - arrival[r] for r, s in stamps.items() if s]
    tbt = [b - a for s in stamps.values() for a, b in zip(s, s[1:])]
    out_tokens = sum(len(s) for s in stamps.values())
    return RunResult(system, len(trace), completed, errors, out_tokens,
                     sum(tr.prompt_len for tr in trace), wall, out_tokens / wall,
                     percentile(ttft, 50), percentile(ttft, 99), percentile(tbt, 50),
                     percentile(tbt, 99), max_batch, bd, engine.prefix_stats()[1] - hits0)


def run_grid_cell(llm, cell: GridCell, system: str, capacity: int) -> GridPoint:
    """Decode throughput of ``cell`` on ``llm`` with the whole batch decoding. The requests
    start together and ask for more tokens than the cell needs, so the first ones prefilled
    keep decoding while the last are prefilled; once every request has its first token, the
    steps that give each request ``new_tokens - 1`` more are timed, then the requests are
    aborted (their KV freed) and the engine drained. ``capacity``: the system's KV slots; a
    cell that needs more, or more requests than ``max_num_seqs``, is reported as not fitting
    (not run). A cell whose requests end before that (their room in the context or the KV ran
    out while the batch was still filling) is reported with the reason in ``note``."""
    sched = _engines(llm)[0].scheduler
    if cell.kv_tokens > capacity or cell.batch > sched.config.max_num_seqs:
        return GridPoint(system, cell.batch, cell.context, False)
    # each request may use its share of the KV (so none is preempted) within the context
    room = capacity // cell.batch - cell.context
    if sched.config.max_model_len is not None:
        room = min(room, sched.config.max_model_len - cell.context)
    engine = llm.deployment
    reqs = [engine.add_request(list(r.prompt_ids), _params(room))
            for r in cell.requests(_engines(llm)[0].vocab_size or 2)]
    ids = {r.req_id for r in reqs}
    full: dict[int, int] | None = None  # each request's output length once all decode
    timed_s, timed_tokens, note = 0.0, 0, ""
    try:
        while engine.has_work():
            t = time.perf_counter()
            out = engine.step()
            dt = time.perf_counter() - t
            if full is not None:
                timed_s += dt
                timed_tokens += sum(rid in ids for rid in out.new_tokens)
                if all(len(r.output_ids) - full[r.req_id] >= cell.new_tokens - 1 for r in reqs):
                    break
            elif all(r.output_ids for r in reqs):
                full = {r.req_id: len(r.output_ids) for r in reqs}
            ended = next((r for r in reqs if r.finished), None)
            if ended is not None:
                note = (f"request {ended.req_id} ended ({ended.error or ended.finish_reason}) after "
                        f"{len(ended.output_ids)} tokens, before the whole batch had decoded "
                        f"{cell.new_tokens} tokens together")
                break
    finally:
        for r in reqs:
            engine.abort(r, RuntimeError("grid cell measured"))
        while engine.has_work():
            engine.step()
        for r in reqs:
            engine.forget(r.req_id)
    if note or not timed_tokens:
        return GridPoint(system, cell.batch, cell.context, True, note=note or "no decode step timed")
    per_request = timed_tokens / cell.batch  # tokens each request got in the timed steps
    return GridPoint(system, cell.batch, cell.context, True, timed_tokens / timed_s,
                     timed_s / per_request)


def left_padded(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, attention_mask)``, int64 ``[B, longest prompt]``: each prompt on the right,
    ``pad_id`` on the left, mask 1 on prompt tokens (as HF decoder-only generation expects)."""
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):  # left padding, as HF expects for decoder-only generation
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    return ids, mask


def hf_generate_time(model, prompts: list[list[int]], new_tokens: int, pad_id: int) -> float:
    """Seconds for HF ``generate`` (greedy, KV cache, left-padded batch) to produce exactly
    ``new_tokens`` tokens for every prompt."""
    ids, mask = left_padded(prompts, pad_id)
    ids, mask = ids.to(model.device), mask.to(model.device)
    t = time.perf_counter()
    with torch.inference_mode():
        model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=new_tokens,
                       min_new_tokens=new_tokens, pad_token_id=pad_id)
    return time.perf_counter() - t


def hf_grid_cell(model, cell: GridCell, pad_id: int, vocab_size: int) -> GridPoint:
    """HF decode throughput of ``cell``, by difference: time(N tokens) - time(1 token)."""
    prompts = [list(r.prompt_ids) for r in cell.requests(vocab_size)]
    full = hf_generate_time(model, prompts, cell.new_tokens, pad_id)
    first = hf_generate_time(model, prompts, 1, pad_id)
    dt = max(full - first, 1e-9)
    steps = cell.new_tokens - 1
    return GridPoint("hf", cell.batch, cell.context, True, cell.batch * steps / dt, dt / steps)


def hf_trace(model, trace: list[TraceRequest], pad_id: int, batch: int,
             progress: bool = True) -> RunResult:
    """HF ``generate`` over the trace's requests sorted by prompt length (least padding),
    ``batch`` at a time, ignoring arrival times: an offline upper bound for a server without
    continuous batching. Each batch decodes up to its longest request; only requested tokens
    count. TTFT and TBT are not measured (NaN)."""
    order = sorted(trace, key=lambda r: r.prompt_len)
    t0 = time.perf_counter()
    for j in tqdm(range(0, len(order), batch), desc="hf", unit="batch", disable=not progress,
                  leave=False):
        chunk = order[j:j + batch]
        hf_generate_time(model, [list(r.prompt_ids) for r in chunk],
                         max(r.output_len for r in chunk), pad_id)
    wall = time.perf_counter() - t0
    out_tokens = sum(r.output_len for r in trace)
    nan = math.nan
    return RunResult("hf", len(trace), len(trace), [], out_tokens,
                     sum(r.prompt_len for r in trace), wall, out_tokens / wall, nan, nan, nan, nan,
                     min(batch, len(trace)), Breakdown(compute_s=wall))
