"""Benchmark workloads: seeded synthetic request traces and batch x context grids.

A trace is a list of :class:`TraceRequest` sorted by arrival time. Arrivals are a Poisson
process of ``rate`` requests/s (exponential gaps; ``rate=inf`` puts every request at t=0).
Lengths are drawn per request, rounded and clipped:

* ``short`` (ShareGPT-like chat): prompt ~ LogNormal(median 180, sigma 0.9) in [4, 2048],
  output ~ LogNormal(median 150, sigma 0.8) in [4, 1024] tokens. ShareGPT conversations
  average a few hundred tokens each way with a long tail.
* ``long`` (L-Eval-like long-document QA/summarisation): prompt ~ LogNormal(median 6000,
  sigma 0.5) in [2048, 16384], output ~ LogNormal(median 128, sigma 0.6) in [16, 512].
* ``mixed``: each request is ``long`` with probability 0.1, else ``short``.

``scale`` multiplies every drawn length (before clipping to ``max_context``), so a CPU run can
keep the shapes of the distributions at a size it can afford; ``max_context`` bounds
prompt + output (the model's maximum length or a pool's capacity). Prompt token ids are drawn
uniformly (seeded) from the vocabulary; benchmarks set ``ignore_eos`` so each request produces
exactly ``output_len`` tokens.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass

TRACE_KINDS = ("short", "long", "mixed")


@dataclass(frozen=True)
class LengthDist:
    """LogNormal(log(median), sigma) rounded and clipped to [lo, hi] tokens."""

    median: float
    sigma: float
    lo: int
    hi: int

    def sample(self, rng: random.Random, scale: float = 1.0) -> int:
        x = rng.lognormvariate(math.log(self.median), self.sigma)
        return max(1, round(min(max(x, self.lo), self.hi) * scale))


SHORT = (LengthDist(180, 0.9, 4, 2048), LengthDist(150, 0.8, 4, 1024))
LONG = (LengthDist(6000, 0.5, 2048, 16384), LengthDist(128, 0.6, 16, 512))
LONG_FRACTION = 0.1


@dataclass(frozen=True)
class TraceRequest:
    """One request of a workload: arrives at ``arrival_s`` (from the start of the run) with
    ``prompt_ids`` and asks for exactly ``output_len`` new tokens. ``kind``: short | long | grid."""

    arrival_s: float
    prompt_ids: tuple[int, ...]
    output_len: int
    kind: str

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)


def _ids(rng: random.Random, n: int, vocab_size: int) -> tuple[int, ...]:
    lo = min(100, vocab_size // 2)  # skip the special tokens at the start of most vocabularies
    return tuple(rng.randrange(lo, vocab_size) for _ in range(n))


def synthetic_trace(kind: str, num_requests: int, rate: float, vocab_size: int, *, seed: int = 0,
                    scale: float = 1.0, max_context: int | None = None) -> list[TraceRequest]:
    """A seeded trace of ``num_requests`` requests of ``kind`` (short | long | mixed) arriving
    as a Poisson process of ``rate`` requests/s (``math.inf``: all at once). Same arguments,
    same trace. Raises ValueError for an unknown kind or non-positive sizes."""
    if kind not in TRACE_KINDS:
        raise ValueError(f"unknown workload {kind!r}: choose one of {', '.join(TRACE_KINDS)} or grid")
    if num_requests < 1 or not rate > 0 or not scale > 0 or vocab_size < 2:
        raise ValueError(f"need num_requests >= 1, rate > 0, scale > 0 and a vocabulary "
                         f"(got {num_requests}, {rate}, {scale}, {vocab_size})")
    if max_context is not None and max_context < 2:
        raise ValueError(f"max_context must be >= 2, got {max_context}")
    rng, id_rng = random.Random(seed), random.Random(f"{seed}/ids")  # lengths apart from ids
    t, out = 0.0, []
    for _ in range(num_requests):
        long = kind == "long" or (kind == "mixed" and rng.random() < LONG_FRACTION)
        p_dist, o_dist = LONG if long else SHORT
        p, o = p_dist.sample(rng, scale), o_dist.sample(rng, scale)
        if max_context is not None and p + o > max_context:
            o = min(o, max(1, max_context // 8))
            p = max(1, min(p, max_context - o))
        out.append(TraceRequest(t, _ids(id_rng, p, vocab_size), o, "long" if long else "short"))
        if math.isfinite(rate):
            t += rng.expovariate(rate)
    return out


@dataclass(frozen=True)
class GridCell:
    """``batch`` requests of ``context`` prompt tokens, all at t=0, each decoding
    ``new_tokens`` tokens: one point of a throughput-vs-batch sweep."""

    batch: int
    context: int
    new_tokens: int

    def requests(self, vocab_size: int, seed: int = 0) -> list[TraceRequest]:
        rng = random.Random(f"{seed}/{self.batch}/{self.context}")
        return [TraceRequest(0.0, _ids(rng, self.context, vocab_size), self.new_tokens, "grid")
                for _ in range(self.batch)]

    @property
    def kv_tokens(self) -> int:
        """KV slots the whole cell needs at its end."""
        return self.batch * (self.context + self.new_tokens)


def grid(batches: list[int], contexts: list[int], new_tokens: int) -> list[GridCell]:
    """Every batch x context cell, batch-major. Raises ValueError for non-positive sizes."""
    if not batches or not contexts or min(batches) < 1 or min(contexts) < 1 or new_tokens < 2:
        raise ValueError(f"grid needs batches >= 1, contexts >= 1 and new_tokens >= 2 "
                         f"(got {batches}, {contexts}, {new_tokens})")
    return [GridCell(b, c, new_tokens) for c in contexts for b in batches]
