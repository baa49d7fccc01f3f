"""Faults under load: a mixed trace while a memory node (or the compute replica) is killed
(SIGKILL) every N seconds of serving, against the same trace unfaulted, in one run (issue 20).

One ``LLM(model, memory=M, placement="procs", prefix_caching=False)`` (every role a process;
no prefix cache, which would carry the first run's KV into the second) serves a seeded
``mixed`` trace (lamina.benchmark.workloads; all requests submitted together, greedy, lengths
scaled by ``--scale``) twice: first unfaulted (the baseline), then while a killer thread waits
``--kill-every`` seconds after the instance last (re)started serving and kills one of its
processes (``--victims``: memory nodes round robin, the compute replica, or both in turn, the
default), until the trace is done or ``--kills`` were made. The deployment restarts the broken
instance and its unfinished requests recompute their KV.

Reports: requests completed and failed, greedy outputs identical to the baseline, kills,
recoveries (and how many were a memory node restarted alone), seconds from each kill to the
instance serving again, tokens recomputed (KV lost with the node and prefilled again), wall time and
per-request latency (p50, max) of both runs and their ratio, and the floor the kills set: the
unfaulted wall plus the restarts plus the lost KV prefilled again at the unfaulted run's prefill
rate (all prompt tokens over the time to the last first token). Writes
bench/results/faults_cpu.{json,md} (``--spare``: faults_cpu_spare.{json,md}).

With ``--instances 2`` the instances' pools lend to each other, and ``--victims lender`` kills a
node on which another instance's request holds KV (the long request of the trace borrows once
``--kv-cache-tokens`` is small): the node is restarted alone and both instances recompute only
their KV that was on it (faults_cpu_borrowing.{json,md}).

    python bench/faults.py                         # smollm2, 12 requests, a kill every 8 s
    python bench/faults.py --kill-every 4 --kills 3
    python bench/faults.py --instances 2 --memory 1 --kv-cache-tokens 1024 --victims lender
"""
from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from lamina import LLM, SamplingParams  # noqa: E402  (before torch: the OpenMP policy)
from lamina.benchmark.workloads import synthetic_trace  # noqa: E402

RESULTS = ROOT / "bench" / "results"


def run_trace(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> dict:
    """Stream the whole trace; per request its tokens, finish reason, latency (s) and time to
    its first token (s)."""
    tokens: list[list[int]] = [[] for _ in prompts]
    reason: list[str | None] = [None] * len(prompts)
    latency = [math.nan] * len(prompts)
    first = [math.nan] * len(prompts)
    t0 = time.perf_counter()
    for d in llm.generate_stream(prompts, params):
        if d.token_ids and math.isnan(first[d.index]):
            first[d.index] = time.perf_counter() - t0
        tokens[d.index] += d.token_ids
        if d.finished:
            reason[d.index] = d.finish_reason
            latency[d.index] = time.perf_counter() - t0
    return dict(tokens=tokens, reason=reason, latency=latency, first=first,
                wall=time.perf_counter() - t0)


class Killer(threading.Thread):
    """Kills a process of instance 0 every ``every`` seconds of serving: its memory nodes round
    robin, or (``victims`` "both") a memory node and the compute replica in turn; or
    (``victims`` "lender", several instances) a memory node that lent KV space another
    instance's request is using (the first such after the wait)."""

    def __init__(self, llm: LLM, every: float, max_kills: int, victims: str) -> None:
        super().__init__(daemon=True)
        self.llm, self.every, self.max_kills, self.victims = llm, every, max_kills, victims
        self.done = threading.Event()
        self.kills: list[tuple[float, str]] = []
        self.back: list[float] = []  # seconds from each kill to the instance serving again

    def victim(self) -> tuple[int, str] | None:
        dep = self.llm.deployment
        if self.victims == "lender":  # a node on which another instance holds KV now
            for ln in dep.loans.values():
                debtor = dep.instances[ln.debtor].scheduler
                if any(sh.node == ln.debtor_node for r in debtor.running for sh in r.shards):
                    node = dep.instances[ln.creditor].nodes[ln.creditor_node]
                    return node.process.pid, (f"instance {ln.creditor}'s memory node "
                                              f"{ln.creditor_node} (lent to instance {ln.debtor})")
            return None
        inst = dep.instances[0]
        n = len(self.kills)
        if self.victims == "replica" or (self.victims == "both" and n % 2 == 1):
            return inst.engine.worker.procs[0].pid, "replica 0"
        k = (n // 2 if self.victims == "both" else n) % len(inst.nodes)
        return inst.nodes[k].process.pid, f"memory node {k}"

    def run(self) -> None:
        dep = self.llm.deployment
        t0 = time.perf_counter()
        while len(self.kills) < self.max_kills:
            seen = dep.recoveries
            if self.done.wait(self.every):
                return
            while (found := self.victim()) is None:  # "lender": until a request borrows
                if self.done.wait(0.05):
                    return
            pid, role = found
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                continue
            killed = time.perf_counter()
            self.kills.append((round(killed - t0, 2), role))
            while dep.recoveries == seen and not self.done.is_set():  # restarted: serving again
                time.sleep(0.01)
            if dep.recoveries != seen:
                self.back.append(time.perf_counter() - killed)


def pct(xs: list[float], q: float) -> float:
    xs = sorted(x for x in xs if not math.isnan(x))
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else math.nan


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--requests", type=int, default=12)
    ap.add_argument("--scale", type=float, default=0.15, help="trace lengths x this")
    ap.add_argument("--max-tokens", type=int, default=48, help="cap on each output length")
    ap.add_argument("--memory", type=int, default=2)
    ap.add_argument("--kill-every", type=float, default=8.0, help="seconds of serving per kill")
    ap.add_argument("--kills", type=int, default=4, help="most kills")
    ap.add_argument("--victims", choices=["memory", "replica", "both", "lender"], default="both",
                    help="memory nodes only, the compute replica only, both in turn, or (with "
                         "--instances > 1) a node that lent KV space a request is using")
    ap.add_argument("--instances", type=int, default=1,
                    help="instances (with borrowing between their pools)")
    ap.add_argument("--kv-cache-tokens", type=int, default=None,
                    help="KV slots per memory node (small: requests borrow)")
    ap.add_argument("--spare", action="store_true",
                    help="keep a role process started ahead (LLM(spare=True)): faster restarts")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=RESULTS)
    a = ap.parse_args(argv)
    # one instance serves both runs: with the prefix cache on, the faulted run would reuse the
    # baseline's KV (and finish before the first kill), so it is off here
    if a.victims == "lender" and a.instances < 2:
        ap.error("--victims lender needs --instances 2 or more")
    with LLM(a.model, memory=a.memory, placement="procs", spare=a.spare, prefix_caching=False,
             instances=a.instances, kv_cache_tokens=a.kv_cache_tokens) as llm:
        vocab = llm.deployment.instances[0].engine.vocab_size or 2
        trace = synthetic_trace("mixed", a.requests, math.inf, vocab, seed=a.seed, scale=a.scale,
                                max_context=1024)
        prompts = [list(r.prompt_ids) for r in trace]
        params = [SamplingParams(temperature=0, max_tokens=min(a.max_tokens, r.output_len),
                                 ignore_eos=True) for r in trace]
        print(f"{len(prompts)} requests, prompts {min(map(len, prompts))}-"
              f"{max(map(len, prompts))} tokens ({sum(r.kind == 'long' for r in trace)} long); "
              f"baseline run", flush=True)
        base = run_trace(llm, prompts, params)
        print(f"baseline {base['wall']:.1f} s; faulted run (a memory node killed every "
              f"{a.kill_every:g} s of serving)", flush=True)
        rec0, tok0 = llm.deployment.recoveries, llm.deployment.recomputed_tokens
        nodes0, whole0 = llm.deployment.node_restarts, llm.deployment.instance_restarts
        killer = Killer(llm, a.kill_every, a.kills, a.victims)
        killer.start()
        fault = run_trace(llm, prompts, params)
        killer.done.set()
        killer.join(30)
        recoveries = llm.deployment.recoveries - rec0
        node_restarts = llm.deployment.node_restarts - nodes0
        instance_restarts = llm.deployment.instance_restarts - whole0
        recomputed = llm.deployment.recomputed_tokens - tok0
    completed = sum(r in ("length", "stop") for r in fault["reason"])
    res = dict(model=a.model, requests=len(prompts), instances=a.instances,
               kv_cache_tokens=a.kv_cache_tokens, memory_nodes=a.memory, spare=a.spare,
               kill_every_s=a.kill_every, kills=len(killer.kills),
               killed=[dict(at_s=t, role=r, back_s=round(b, 2) if b is not None else None)
                       for (t, r), b in zip(killer.kills, killer.back + [None] * len(killer.kills))],
               recoveries=recoveries, node_restarts=node_restarts,
               instance_restarts=instance_restarts, completed=completed,
               failed=sum(r == "error" for r in fault["reason"]),
               identical=sum(x == y for x, y in zip(fault["tokens"], base["tokens"])),
               generated_tokens=sum(map(len, fault["tokens"])), recomputed_tokens=recomputed,
               wall_s=dict(baseline=round(base["wall"], 2), faulted=round(fault["wall"], 2)),
               latency_p50_s=dict(baseline=round(pct(base["latency"], 0.5), 2),
                                  faulted=round(pct(fault["latency"], 0.5), 2)),
               latency_max_s=dict(baseline=round(pct(base["latency"], 1.0), 2),
                                  faulted=round(pct(fault["latency"], 1.0), 2)))
    ratio = fault["wall"] / base["wall"]
    # What the kills cost at the least: the restarts, plus recomputing the lost KV at the
    # unfaulted run's prefill rate (every prompt token over the time to the last first token).
    prefill_rate = sum(map(len, prompts)) / max(base["first"])
    floor = base["wall"] + sum(killer.back) + recomputed / prefill_rate
    res.update(prefill_tokens_per_s=round(prefill_rate, 1), floor_s=round(floor, 2),
               floor_ratio=round(floor / base["wall"], 3))
    md = ["# Faults under load (bench/faults.py)", "",
          f"{a.model}, {len(prompts)} requests of a seeded mixed trace (greedy), "
          + (f"{a.instances} instances borrowing KV space from each other "
             f"({a.kv_cache_tokens} slots per node), " if a.instances > 1 else "")
          + f"{a.memory} memory node{'s' if a.memory != 1 else ''}"
          f"{' each' if a.instances > 1 else ''}, every role a process"
          f"{' (a spare kept ahead)' if a.spare else ''}"
          f"; a process SIGKILLed every "
          f"{a.kill_every:g} s of serving (at most {a.kills}): "
          + ", ".join(f"{r} at {t:g} s" for t, r in killer.kills) + ".", "",
          "| what | value |", "|---|---:|",
          "| kills / recoveries (memory nodes restarted alone, instances restarted whole) | "
          f"{res['kills']} / {recoveries} ({node_restarts}, {instance_restarts}) |",
          "| kill to serving again, s (each) | "
          + (", ".join(f"{r}: {b:.1f}" for (_, r), b in zip(killer.kills, killer.back)) or "-")
          + " |",
          f"| completed / failed | {completed} / {res['failed']} of {len(prompts)} |",
          f"| greedy outputs identical to the unfaulted run | {res['identical']} of {len(prompts)} |",
          f"| tokens generated / KV tokens recomputed | {res['generated_tokens']} / {recomputed} |",
          f"| wall s (unfaulted / faulted) | {base['wall']:.1f} / {fault['wall']:.1f} "
          f"({ratio:.2f}x) |",
          f"| floor: unfaulted + restarts + recompute at {prefill_rate:.0f} prefill tokens/s "
          f"| {floor:.1f} s ({floor / base['wall']:.2f}x) |",
          f"| latency p50 s (unfaulted / faulted) | {res['latency_p50_s']['baseline']} / "
          f"{res['latency_p50_s']['faulted']} |",
          f"| latency max s (unfaulted / faulted) | {res['latency_max_s']['baseline']} / "
          f"{res['latency_max_s']['faulted']} |"]
    text = "\n".join(md) + "\n"
    print(text)
    a.out.mkdir(parents=True, exist_ok=True)
    name = "faults_cpu" + ("_borrowing" if a.instances > 1 else "") + ("_spare" if a.spare else "")
    (a.out / f"{name}.json").write_text(json.dumps(res, indent=1))
    (a.out / f"{name}.md").write_text(text)
    print(f"wrote {a.out / name}.json and .md")


if __name__ == "__main__":
    main()
