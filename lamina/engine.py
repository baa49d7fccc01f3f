"""The engine: requests in, tokens out. One scheduler, one compute replica, one memory pool.

Each ``step()`` forms a StepPlan for one micro-batch (continuous batching, chunked prefill) and
its per-node routes, has a compute replica (a :class:`~lamina.worker.WorkerClient`, in this
process or in a Ray actor) execute it, and applies stop conditions. The per-micro-batch state lives in :class:`MicroBatch`, so several can
be in flight once pipelining lands; today one is in flight at a time.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from lamina.request import Request
from lamina.routing import NodeRoute, build_routes
from lamina.scheduler import ScheduledSegment, Scheduler, SchedulerConfig
from lamina.types import SamplingParams, Segment, StepPlan
from lamina.worker import WorkerClient


@dataclass
class MicroBatch:
    """One in-flight iteration: its plan, segments and per-node routes."""

    plan: StepPlan
    segs: list[ScheduledSegment]
    routes: list[NodeRoute]


@dataclass
class StepOutput:
    """Tokens produced by one step: ``new_tokens[req_id]`` and the requests that finished."""

    new_tokens: dict[int, int] = field(default_factory=dict)
    finished: list[Request] = field(default_factory=list)


class Engine:
    def __init__(self, worker: WorkerClient, capacities: list[int], config: SchedulerConfig,
                 eos_token_ids: set[int] | None = None, tokenizer=None,
                 vocab_size: int | None = None):
        self.worker = worker
        self.vocab_size = vocab_size
        self.scheduler = Scheduler(capacities, config)
        self.eos = set(eos_token_ids or ())
        self.tokenizer = tokenizer
        self.requests: dict[int, Request] = {}
        self._ids = itertools.count()
        self._steps = itertools.count()

    # -- requests ----------------------------------------------------------------------------------
    def add_request(self, prompt_ids: list[int], params: SamplingParams) -> Request:
        """Queue a request; raises ValueError (nothing queued) if it can never run."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"expected SamplingParams, got {type(params).__name__}")
        vocab = self.vocab_size
        if any((not isinstance(t, int)) or t < 0 or (vocab and t >= vocab) for t in prompt_ids):
            raise ValueError(f"prompt token ids must be ints in [0, {vocab})")
        req = Request(next(self._ids), list(prompt_ids), params)
        self.scheduler.add(req)
        self.requests[req.req_id] = req
        return req

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    # -- one iteration -----------------------------------------------------------------------------
    def step(self) -> StepOutput:
        out = StepOutput()
        segs, preempted = self.scheduler.schedule()
        out.finished.extend(r for r in preempted if r.finished)  # failed: out of KV memory
        self._free([r.req_id for r in preempted])
        if not segs:
            return out
        mb = self._form(segs)
        sampled = [s for s in segs if s.sample]
        tokens = self.worker.execute(mb.plan, mb.routes, [s.req.req_id for s in sampled],
                                     [s.req.params for s in sampled])
        self.scheduler.commit(segs)
        finished_ids = []
        for seg, tok in zip(sampled, tokens):
            req = seg.req
            req.output_ids.append(tok)
            out.new_tokens[req.req_id] = tok
            reason = self._stop_reason(req, tok)
            if reason:
                self.scheduler.finish(req, reason)
                finished_ids.append(req.req_id)
                out.finished.append(req)
        self._free(finished_ids)
        return out

    def _form(self, segs: list[ScheduledSegment]) -> MicroBatch:
        ids, pos, rows = [], [], []
        for s in segs:
            ids.extend(s.req.all_ids[s.start:s.start + s.num_tokens])
            pos.extend(range(s.start, s.start + s.num_tokens))
            if s.sample:
                rows.append(len(ids) - 1)
        step_id = next(self._steps)
        plan = StepPlan(step_id, 0, [Segment(s.req.req_id, s.start, s.num_tokens) for s in segs],
                        torch.tensor(ids, dtype=torch.long), torch.tensor(pos, dtype=torch.long),
                        torch.tensor(rows, dtype=torch.long))
        return MicroBatch(plan, segs, build_routes(segs, len(ids)))

    def _stop_reason(self, req: Request, tok: int) -> str | None:
        p = req.params
        if not p.ignore_eos and tok in self.eos:
            return "stop"
        if tok in p.stop_token_ids:
            return "stop"
        if p.stop and self.tokenizer is not None:
            text = self.tokenizer.decode(req.output_ids, skip_special_tokens=True)
            if any(s in text for s in p.stop):
                return "stop"
        if len(req.output_ids) >= p.max_tokens:
            return "length"
        limit = self.scheduler.config.max_model_len
        if limit is not None and req.num_tokens >= limit:
            return "length"
        return None

    def _free(self, req_ids: list[int]) -> None:
        if req_ids:
            self.worker.free(req_ids, release=req_ids)

    def abort(self, req: Request, error: Exception) -> None:
        if not req.finished:
            if req in self.scheduler.waiting:
                self.scheduler.waiting.remove(req)
            self.scheduler.finish(req, "error")
            req.error = error
            self._free([req.req_id])

