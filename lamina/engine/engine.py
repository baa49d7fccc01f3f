"""The engine: requests in, tokens out. One scheduler, the compute replicas, one memory pool.

Each ``step()`` forms a StepPlan (continuous batching, chunked prefill) and its routes for every
free micro-batch slot, has the compute replicas (a :class:`~lamina.engine.worker.WorkerClient`)
run them, and applies stop conditions to those that finish. With ``n`` slots (staggered
pipelining) a request belongs to at most one micro-batch in flight, re-formed as it finishes.
"""
from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, field

import torch

from lamina.config import SchedulerConfig
from lamina.engine.detokenize import IncrementalText, stop_found
from lamina.engine.micro_batch_choice import MicroBatchChoice
from lamina.engine.prefix_cache import Drop, PrefixCache
from lamina.engine.request import Request, Status
from lamina.engine.routes import build_routes
from lamina.engine.scheduler import Lender, ScheduledSegment, Scheduler
from lamina.engine.worker import WorkerClient
from lamina.transport.node_client import NodeClient
from lamina.types import KVChunk, NodeRoute, SamplingParams, Segment, StepPlan

log = logging.getLogger("lamina.engine")
ID_STRIDE = 1 << 40  # an engine's request and step ids: [id_base, id_base + ID_STRIDE)


@dataclass
class InFlight:
    """A micro-batch in flight as the engine keeps it (the replicas': ``microbatch.MicroBatch``)."""

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
                 vocab_size: int | None = None, id_base: int = 0, lender: Lender | None = None,
                 micro_batches: int = 1, prefix_caching: bool = False, adapt: bool = False):
        """``micro_batches``: slots in flight at once (the instance's pipeline config; the
        worker must accept as many); ``adapt``: use either 1 or ``micro_batches`` of them,
        whichever decodes faster as timed while serving (:mod:`~lamina.engine.micro_batch_choice`).
        ``id_base`` starts this engine's request and step ids, so
        engines whose pools lend to each other never share an id on a memory node; ``lender``
        (cluster borrowing) supplies KV space beyond ``capacities``; ``prefix_caching``: keep
        computed KV on the nodes for later requests that share its prefix
        (:mod:`lamina.engine.prefix_cache`; cache entries have negative ids on the nodes)."""
        self.worker = worker
        self.micro_batches = micro_batches
        self.choice = MicroBatchChoice((micro_batches, 1)) if adapt and micro_batches > 1 \
            else None
        self.vocab_size = vocab_size
        cache = PrefixCache(len(capacities)) if prefix_caching else None
        self.scheduler = Scheduler(capacities, config, lender, cache)
        self.eos = set(eos_token_ids or ())
        self.tokenizer = tokenizer
        self.requests: dict[int, Request] = {}
        self.id_base = id_base
        self.own_nodes = len(capacities)  # nodes of its own pool; attached ones come after
        self._ids = itertools.count(id_base)
        self._steps = itertools.count(id_base)
        self._in_flight: dict[int, InFlight] = {}  # slot -> micro-batch
        self._aborted: dict[int, Exception] = {}  # req_id -> error, applied at completion
        self.dropped: list[int] = []  # steps dropped in flight by a worker error, not yet cancelled
        self.consistent = True  # the scheduler's view of the KV matches the nodes' (see recover)

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

    def add_precomputed(self, prompt_ids: list[int], params: SamplingParams,
                        kv_shape: tuple[int, int, int], chunk: int = 256) -> Request:
        """Benchmarks: a request whose prompt but the last token counts as prefilled, its KV
        written as zeros straight into the memory nodes (IMPORT, ``chunk`` positions at a
        time; ``kv_shape`` = (layers, kv_heads, head_dim) of the nodes' pools); its first step
        decodes the last prompt token. Attention's speed does not depend on the KV's values,
        so decode over such a context times like decode after a real prefill."""
        req = self.add_request(prompt_ids, params)
        try:
            appends = self.scheduler.admit_computed(req, len(prompt_ids) - 1)
        except ValueError:
            self.scheduler.waiting.remove(req)
            del self.requests[req.req_id]
            raise
        L, hkv, d = kv_shape
        for node, start, count in appends:
            for s in range(start, start + count, chunk):
                zeros = torch.zeros(L, min(chunk, start + count - s), hkv, d)
                self.worker.nodes[node].import_kv(KVChunk(req.req_id, s, zeros, zeros))
        return req

    def has_work(self) -> bool:
        return self.scheduler.has_work() or bool(self._in_flight)

    def busy(self) -> set[int]:
        """Requests in a micro-batch in flight (their KV must not move)."""
        return {s.req.req_id for mb in self._in_flight.values() for s in mb.segs}

    def attach(self, client: NodeClient, capacity: int) -> int:
        """Another pool's node, of which ``capacity`` slots are lent to this engine; returns its
        index in this engine's routes and scheduler."""
        index = self.worker.attach(client)
        if self.scheduler.add_node(capacity) != index:
            raise RuntimeError("worker and scheduler disagree on the number of memory nodes")
        return index

    # -- one iteration -----------------------------------------------------------------------------
    def step(self) -> StepOutput:
        """Fill every free micro-batch slot with a newly formed micro-batch, then wait until at
        least one micro-batch in flight finishes its iteration and apply its tokens. With one
        slot (no pipelining) this is one iteration of the single batch. A worker error drops
        every micro-batch in flight and propagates."""
        out = StepOutput()
        self.start_step(out)
        self.finish_step(out)
        return out

    def start_step(self, out: StepOutput) -> None:
        """The first half of :meth:`step`: schedule and submit (a remote worker runs the step
        while the caller goes on, e.g. with other instances' steps)."""
        self._fill(out)

    def finish_step(self, out: StepOutput) -> None:
        """The second half of :meth:`step`: wait for a micro-batch and apply its tokens."""
        if not self._in_flight:
            return
        try:
            done = self.worker.wait()
        except BaseException:
            self._drop_in_flight()
            raise
        for slot, tokens in done:
            self._complete(self._in_flight.pop(slot), tokens, out)

    def _drop_in_flight(self) -> None:
        """Forget every micro-batch in flight (after an error): the replicas drop them, their
        slot reservations go back to the scheduler, their step ids wait in :attr:`dropped`
        for the nodes to roll back (:meth:`recover`). Never raises past the error being
        handled: a reservation that cannot be given back leaves :attr:`consistent` False
        (then only a fresh engine, which recomputes everything, may take the requests on)."""
        if not self._in_flight:
            return
        self.worker.reset()
        for mb in self._in_flight.values():
            try:
                self.scheduler.unplace(mb.segs)
            except RuntimeError as e:
                self.consistent = False
                log.warning("engine: %s", e)
        self.dropped += [mb.plan.step_id for mb in self._in_flight.values()]
        self._in_flight.clear()

    def adopt(self, requests: list[Request], after: "Engine") -> None:
        """Take over the unfinished ``requests`` of engine ``after`` (whose replicas or nodes
        died): each goes back to WAITING with no KV and recomputes prompt + outputs so far
        (recompute preemption), in the given order; ids continue past ``after``'s. ``after``'s
        finished requests stay readable here until their caller forgets them (one may have
        finished in the very step whose failure brought this engine in)."""
        self._ids = itertools.count(max([next(after._ids)] + [r.req_id + 1 for r in requests]))
        self._steps = itertools.count(next(after._steps))
        self.requests.update({rid: r for rid, r in after.requests.items() if r.finished})
        for req in requests:
            req.shards, req.num_computed, req.num_cached, req.cache_last = [], 0, 0, None
            req.status = Status.WAITING
            req.num_preemptions += 1
            self.requests[req.req_id] = req
            self.scheduler.waiting.append(req)

    def recover(self, lost: set[int], out: StepOutput) -> int:
        """After a role died and was replaced alone (memory nodes ``lost`` by empty ones, to
        which the worker's clients already point; or a compute replica, ``lost`` empty): the
        steps dropped in flight are cancelled on every node, requests aborted meanwhile end,
        and each request with KV on a lost node frees the rest of its KV and goes back to the
        queue to recompute; the others keep theirs. Returns the KV tokens to recompute."""
        self._drop_in_flight()  # where the failure surfaced outside wait (a FREE, say)
        if not self.consistent:
            raise RuntimeError("the scheduler's view of the KV no longer matches the nodes'")
        if self.dropped:
            self.worker.cancel(self.dropped)
            self.dropped = []
            self._trim(lost)
        for req_id, error in list(self._aborted.items()):
            del self._aborted[req_id]
            req = self.requests.get(req_id)
            if req is not None and not req.finished:
                self.abort(req, error)
                out.finished.append(req)
        for k in lost:
            self.scheduler.drop_cached(k)
        redo = [r for r in self.scheduler.running if any(s.node in lost for s in r.shards)]
        tokens = sum(r.num_computed for r in redo)
        for req in redo:
            self.scheduler.preempt(req)
        self._free([r.req_id for r in redo])
        for k in lost:
            if self.scheduler.free[k] != self.scheduler.capacity[k]:
                raise RuntimeError(f"memory node {k} was replaced, yet the scheduler still "
                                   f"places {self.scheduler.capacity[k] - self.scheduler.free[k]}"
                                   " slots on it")
        return tokens

    def _trim(self, lost: set[int]) -> None:
        """Make each surviving node hold no more of a request than the scheduler placed there:
        a dropped step may have been attended in full on a node (its RESULTs then went
        nowhere), which no cancel rolls back; its positions are freed from the shard's back."""
        cache = self.scheduler.cache
        for k, st in enumerate(self.worker.stats()):
            if k in lost:
                continue
            for req_id, (start, n) in st.shards.items():
                if req_id < 0 and (k >= self.own_nodes or (cache is not None
                                                           and cache.is_entry(req_id))):
                    continue  # a cached prefix (here, or the lending pool's): no step touches it
                if req_id >= 0 and not self.id_base <= req_id < self.id_base + ID_STRIDE:
                    continue  # another engine's request, on a node shared by borrowing
                req = self.requests.get(req_id)
                mine = [s for s in req.shards if s.node == k] if req is not None else []
                end = max(start, mine[0].end) if mine else start
                if start + n > end:
                    self.worker.nodes[k].free_range(req_id, end, start + n)

    def forget(self, req_id: int) -> None:
        """Drop a finished request from ``requests`` (its caller has read it)."""
        self.requests.pop(req_id, None)

    def counts(self) -> tuple[int, int]:
        """(running, waiting) requests."""
        return len(self.scheduler.running), len(self.scheduler.waiting)

    def prefix_stats(self) -> tuple[int, int, int]:
        """Prefix cache: (prompt tokens looked up, of which cached, slots held); zeros without."""
        cache = self.scheduler.cache
        return cache.stats() if cache is not None else (0, 0, 0)

    def kv_slots(self) -> tuple[list[int], list[int]]:
        """(used, capacity) KV slots of each of this engine's memory nodes (asks the nodes)."""
        return [s.used_slots for s in self.worker.stats()], list(self.scheduler.capacity)

    def _fill(self, out: StepOutput) -> None:
        """Form a micro-batch for each free slot with work, then submit each one (``alone``:
        the only one in flight)."""
        cfg = self.scheduler.config
        n = self.micro_batches
        if self.choice is not None and len(self.scheduler.running) + len(
                self.scheduler.waiting) <= cfg.max_num_seqs:  # else one micro-batch cannot hold all
            n = self.choice.current
        formed: list[InFlight] = []
        for slot in range(n):
            if slot in self._in_flight:
                continue
            busy = self.busy()
            max_seqs = None
            if n > 1:  # spread the requests over the micro-batches
                active = len(self.scheduler.running) + len(self.scheduler.waiting)
                max_seqs = max(1, min(cfg.max_num_seqs, -(-active // n)))
            segs, preempted = self.scheduler.schedule(busy, max_seqs, cfg.max_num_seqs * n)
            out.finished.extend(r for r in preempted if r.finished)  # failed: out of KV memory
            self._free([r.req_id for r in preempted])  # first: one may be re-admitted on a hit
            self._apply_cache_ops()
            if not segs:
                break
            self._in_flight[slot] = mb = self._form(segs, slot)  # busy() sees its requests
            formed.append(mb)
        for mb in formed:
            mb.plan.alone = len(self._in_flight) == 1
            sampled = [s for s in mb.segs if s.sample]
            self.worker.submit(mb.plan.micro_batch, mb.plan, mb.routes,
                               [s.req.req_id for s in sampled], [s.req.params for s in sampled])

    def _complete(self, mb: InFlight, tokens: list[int], out: StepOutput) -> None:
        segs = mb.segs
        self.scheduler.commit(segs)
        finished_ids = []
        for seg, tok in zip([s for s in segs if s.sample], tokens):
            req = seg.req
            if req.req_id in self._aborted:
                continue
            req.output_ids.append(tok)
            out.new_tokens[req.req_id] = tok
            reason = self._stop_reason(req, tok)
            if reason:
                self.scheduler.finish(req, reason)
                finished_ids.append(req.req_id)
                out.finished.append(req)
        self._apply_cache_ops()
        self._free(finished_ids)
        if self.choice is not None:
            self.choice.record(len(tokens), all(s.num_tokens == 1 for s in segs),
                               time.perf_counter())
        for seg in segs:  # aborted while in flight: now its KV can go
            error = self._aborted.pop(seg.req.req_id, None)
            if error is not None:
                self.abort(seg.req, error)

    def _form(self, segs: list[ScheduledSegment], slot: int = 0) -> InFlight:
        """The micro-batch of ``segs``, ordered by the nodes holding each request (stable), so
        that each node's rows are one run of the step's rows and ATTEND/RESULT need no gather."""
        segs = sorted(segs, key=lambda s: (s.req.shards[0].node, s.req.shards[-1].node)
                      if s.req.shards else (-1, -1))
        ids, pos, rows = [], [], []
        for s in segs:
            ids.extend(s.req.all_ids[s.start:s.start + s.num_tokens])
            pos.extend(range(s.start, s.start + s.num_tokens))
            if s.sample:
                rows.append(len(ids) - 1)
        step_id = next(self._steps)
        plan = StepPlan(step_id, slot, [Segment(s.req.req_id, s.start, s.num_tokens) for s in segs],
                        torch.tensor(ids, dtype=torch.long), torch.tensor(pos, dtype=torch.long),
                        torch.tensor(rows, dtype=torch.long))
        return InFlight(plan, segs, build_routes(segs))

    def _stop_reason(self, req: Request, tok: int) -> str | None:
        p = req.params
        if not p.ignore_eos and tok in self.eos:
            return "stop"
        if tok in p.stop_token_ids:
            return "stop"
        if p.stop and self.tokenizer is not None:
            req.decoded = req.decoded or IncrementalText()
            if stop_found(req.decoded, req.output_ids, self.tokenizer, p.stop):
                return "stop"
        if len(req.output_ids) >= p.max_tokens:
            return "length"
        limit = self.scheduler.config.max_model_len
        if limit is not None and req.num_tokens >= limit:
            return "length"
        if req.num_tokens >= self.scheduler.max_capacity:  # its KV could grow no further
            return "length"
        return None

    def reclaim(self, node: int, slots: int) -> None:
        """Evict cached prefixes on own memory node ``node`` until ``slots`` slots are free
        there, or as many as can be (before lending them to another pool)."""
        self.scheduler.reclaim(node, slots)
        self._apply_cache_ops()

    def _apply_cache_ops(self) -> None:
        """The prefix cache's node calls since the last (before its slots are freed or reused)."""
        if self.scheduler.cache is None:
            return
        for op in self.scheduler.cache.take_ops():
            node = self.worker.nodes[op.node]
            if isinstance(op, Drop):
                node.free_range(op.entry, op.start, op.end)
            else:
                node.share(op.dst, op.parts)

    def _free(self, req_ids: list[int]) -> None:
        if req_ids:
            self.worker.free(req_ids, release=req_ids)

    def abort(self, req: Request, error: Exception) -> None:
        """Finish ``req`` with ``error`` and free its KV; a request in a micro-batch in flight is
        finished when that micro-batch completes (its last token is dropped)."""
        if req.finished:
            return
        if any(s.req is req for mb in self._in_flight.values() for s in mb.segs):
            self._aborted[req.req_id] = error
            return
        if req in self.scheduler.waiting:
            self.scheduler.waiting.remove(req)
        self.scheduler.finish(req, "error")
        req.error = error
        self._free([req.req_id])

