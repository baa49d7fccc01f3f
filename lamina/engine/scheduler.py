"""Continuous batching with chunked prefill, KV accounting across a memory pool, and
recompute preemption (pure Python, no torch; the engine turns its output into tensors).

Placement (request-level partitioning): a request's new tokens go to its tail shard's node
while it has room; when that node is full the request opens a new shard on the node with the
most free slots among those that hold none of it, so one request can outgrow any single node.
The scheduler mirrors each node's free slot count; memory nodes stay the authority (an
allocation they refuse is a bug surfaced as an error, never silent).

With a prefix cache (:mod:`lamina.engine.prefix_cache`) an admitted request starts on its
longest cached prefix, placed on the node that holds it; the cache's slots count as used
until evicted, least recently used first, when a placement finds no room (before borrowing or
preempting). Each prefill chunk's KV on a request's first node joins the cache when the chunk
is committed, and the rest of it (the generated tokens) when the request finishes.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Protocol

from lamina.engine.prefix_cache import Hit, PrefixCache
from lamina.engine.request import Request, ShardPlacement, Status
from lamina.config import SchedulerConfig
from lamina.errors import ContextLengthExceeded


@dataclass
class ScheduledSegment:
    """``req`` feeds ``all_ids[start:start+num_tokens]``; ``appends`` says which node stores which
    positions: ``[(node, first_position, count), ...]``. ``sample`` is true when the segment
    reaches the end of the request's known tokens (a new token will be sampled)."""

    req: Request
    start: int
    num_tokens: int
    appends: list[tuple[int, int, int]]
    sample: bool


class Lender(Protocol):
    """Where a scheduler gets KV space beyond its own pool (cluster borrowing,
    :mod:`lamina.deployment.borrowing`)."""

    def cluster_slots(self) -> int:
        """KV slots of every pool together, this one included: what one request could reach."""

    def borrow(self, req: Request, num_slots: int) -> bool:
        """Try to add at least ``num_slots`` slots this request can place its next positions on
        (new nodes via :meth:`Scheduler.add_node`, or more on its tail's borrowed node via
        :meth:`Scheduler.resize`); False (nothing changed) when no pool has room."""


class Scheduler:
    def __init__(self, node_capacities: list[int], config: SchedulerConfig,
                 lender: Lender | None = None, cache: PrefixCache | None = None):
        self.capacity = list(node_capacities)
        self.free = list(node_capacities)
        self.config = config
        self.lender = lender
        self.cache = cache
        self.computed_tokens = 0  # positions run through the model (prefill, decode, recompute)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._busy: frozenset[int] | set[int] = frozenset()  # in flight during schedule()

    @property
    def total_capacity(self) -> int:
        return sum(self.capacity)

    # -- capacity changes (borrowing) --------------------------------------------------------------
    def add_node(self, capacity: int) -> int:
        """A node this scheduler may place on from now on (e.g. another pool's node lending
        ``capacity`` slots); returns its index."""
        self.capacity.append(capacity)
        self.free.append(capacity)
        return len(self.capacity) - 1

    def resize(self, node: int, delta: int) -> None:
        """Grow (lent to us, or lent space returned) or shrink (lent out, given back) a node's
        capacity by ``delta`` slots; shrinking takes free slots only (ValueError otherwise)."""
        if self.free[node] + delta < 0:
            raise ValueError(f"node {node} has {self.free[node]} free slots, cannot give {-delta}")
        self.capacity[node] += delta
        self.free[node] += delta

    @property
    def max_capacity(self) -> int:
        """The most KV one request could ever get: every pool's with borrowing, else this one's."""
        return self.lender.cluster_slots() if self.lender else self.total_capacity

    def _room(self, req: Request) -> int:
        """Free slots req could place on: its tail node's and those of nodes it does not use."""
        used = {s.node for s in req.shards}
        tail = req.shards[-1].node if req.shards else None
        return sum(f for i, f in enumerate(self.free) if i == tail or i not in used)

    def move_prefix(self, req: Request, node: int, count: int) -> None:
        """Account for the first ``count`` positions of req's first shard now living on ``node``
        (a node req does not use; its KV was moved there)."""
        first = req.shards[0]
        if (count >= first.length or node in {s.node for s in req.shards} or self.free[node] < count
                or req.num_cached):
            raise ValueError(f"request {req.req_id}: cannot move {count} positions to node {node}")
        self.free[node] -= count
        self.free[first.node] += count
        req.shards.insert(0, ShardPlacement(node, first.start, count))
        first.start += count
        first.length -= count

    def _borrow(self, req: Request, n: int) -> bool:
        return self.lender is not None and self.lender.borrow(req, n)

    def check_admissible(self, req: Request) -> None:
        """Raise ValueError for a request that can never run (before it is queued)."""
        n = len(req.prompt_ids)
        if n == 0:
            raise ValueError(f"request {req.req_id}: empty prompt")
        cap = self.max_capacity
        if n + 1 > cap:
            raise ValueError(f"request {req.req_id}: prompt of {n} tokens does not fit in the KV "
                             f"capacity of all memory nodes together ({cap} tokens)")
        limit = self.config.max_model_len
        if limit is not None and n >= limit:
            raise ValueError(f"request {req.req_id}: prompt of {n} tokens exceeds the model's "
                             f"maximum length of {limit} tokens")
        if limit is not None and n + req.params.max_tokens > limit:
            raise ContextLengthExceeded(limit, n, req.params.max_tokens)

    def add(self, req: Request) -> None:
        self.check_admissible(req)
        self.waiting.append(req)

    def admit_computed(self, req: Request, n: int) -> list[tuple[int, int, int]]:
        """Start waiting ``req`` with its first ``n`` positions placed and counted as computed
        (their KV is written by the caller, not by a prefill: synthetic contexts for
        benchmarks); returns the placement ``[(node, first_position, count), ...]``. Raises
        ValueError (``req`` stays waiting) when the positions do not fit."""
        if req not in self.waiting or req.num_computed or not 0 < n < req.num_tokens:
            raise ValueError(f"request {req.req_id}: cannot admit {n} computed positions")
        appends = self._place(req, n)
        if appends is None:
            raise ValueError(f"request {req.req_id}: {n} positions do not fit in the pool")
        self.waiting.remove(req)
        req.status = Status.RUNNING
        req.num_computed = n
        self.running.append(req)
        return appends

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # -- placement -------------------------------------------------------------------------------
    def _place(self, req: Request, n: int) -> list[tuple[int, int, int]] | None:
        """Reserve slots for req's next n positions; None (nothing reserved) if they do not fit."""
        plan: list[tuple[int, int, int]] = []
        free = list(self.free)
        pos = req.num_computed
        used = {s.node for s in req.shards}
        tail = req.shards[-1].node if req.shards else None
        left = n
        while left:
            if tail is None or free[tail] == 0:
                candidates = [i for i in range(len(free)) if i not in used and free[i] > 0]
                if not candidates:
                    return None
                tail = max(candidates, key=lambda i: (free[i], -i))
                used.add(tail)
            take = min(left, free[tail])
            free[tail] -= take
            plan.append((tail, pos, take))
            pos += take
            left -= take
        self.free = free
        for node, start, count in plan:
            if req.shards and req.shards[-1].node == node:
                req.shards[-1].length += count
            else:
                req.shards.append(ShardPlacement(node, start, count))
        req.max_shards = max(req.max_shards, len(req.shards))
        return plan

    def release(self, req: Request, kept: int = 0) -> list[int]:
        """Forget req's KV (finished or preempted); returns the nodes that held some. Its
        cached prefix and ``kept`` more positions of its first shard (taken over by the
        prefix cache) stay counted as used."""
        nodes = []
        for s in req.shards:
            self.free[s.node] += s.length
            nodes.append(s.node)
        if req.shards:
            self.free[req.shards[0].node] -= req.num_cached + kept
        if req.cache_last is not None:
            self.cache.release(req.cache_last)
        req.shards, req.num_computed, req.num_cached, req.cache_last = [], 0, 0, None
        return nodes

    # -- prefix cache ------------------------------------------------------------------------------
    def _hit(self, req: Request) -> Hit | None:
        """Start waiting ``req`` on its longest cached prefix (undone by :meth:`_unhit` if it is
        not placed after all)."""
        if self.cache is None or req.shards:
            return None
        hit = self.cache.attach(req.req_id, req.all_ids)
        if hit is not None:
            req.shards = [ShardPlacement(hit.node, 0, hit.length)]
            req.num_computed = req.num_cached = hit.length
        return hit

    def _unhit(self, req: Request, hit: Hit | None) -> None:
        if hit is not None:
            self.cache.release(hit.last)
            req.shards, req.num_computed, req.num_cached = [], 0, 0

    def _admitted(self, req: Request, hit: Hit | None) -> None:
        if self.cache is None:
            return
        if hit is None:
            self.cache.miss(len(req.prompt_ids))
        else:
            self.cache.commit(hit, len(req.prompt_ids))
            req.cache_last = hit.last
        if req.num_cached_tokens is None:
            req.num_cached_tokens = req.num_cached

    def _place_evicting(self, req: Request, n: int) -> list[tuple[int, int, int]] | None:
        """:meth:`_place`, evicting cached prefixes (least recently used first) while they
        are in the way."""
        appends = self._place(req, n)
        while appends is None and self.cache is not None \
                and self._evict(max(1, n - self._room(req))):
            appends = self._place(req, n)
        return appends

    def _evict(self, slots: int, node: int | None = None) -> bool:
        """Evict cached prefixes (on ``node`` only, if given) for ``slots`` slots; whether any
        slot was freed."""
        freed = self.cache.evict(slots, node)
        for k, count in freed:
            self.free[k] += count
        return bool(freed)

    def reclaimable(self, node: int) -> int:
        """Free slots of ``node`` plus those its cached prefixes hold that no request uses."""
        cached = self.cache.evictable(node) if self.cache is not None else 0
        return self.free[node] + cached

    def reclaim(self, node: int, slots: int) -> None:
        """Evict cached prefixes on ``node`` until it has ``slots`` free slots, or as many as
        it can (for lending them to another pool)."""
        if self.cache is not None and self.free[node] < slots:
            self._evict(slots - self.free[node], node)

    def drop_cached(self, node: int) -> None:
        """Memory node ``node`` was replaced by an empty one: its cached prefixes are gone."""
        if self.cache is not None and node < len(self.cache.held):
            self.free[node] += self.cache.drop_node(node)

    # -- scheduling ------------------------------------------------------------------------------
    def schedule(self, busy: frozenset[int] | set[int] = frozenset(), max_seqs: int | None = None,
                 max_running: int | None = None) -> tuple[list[ScheduledSegment], list[Request]]:
        """Form the next step (one micro-batch): running requests first (decodes and unfinished
        prefills, FIFO), then waiting ones while the token budget, ``max_seqs`` (requests in
        this step; default ``max_num_seqs``) and ``max_running`` (running requests in all
        micro-batches; default ``max_num_seqs``) allow. Requests in ``busy`` (in another
        micro-batch in flight) are neither scheduled nor preempted. Returns the segments and
        the requests preempted to make room (their KV must be freed on the nodes)."""
        budget = self.config.max_num_batched_tokens
        max_seqs = max_seqs or self.config.max_num_seqs
        max_running = max_running or self.config.max_num_seqs
        segs: list[ScheduledSegment] = []
        preempted: list[Request] = []
        self._busy = busy
        queue = [r for r in self.running if r.req_id not in busy]
        while queue and budget > 0 and len(segs) < max_seqs:
            req = queue.pop(0)
            n = min(req.num_tokens - req.num_computed, budget)
            appends = self._place_evicting(req, n)
            if appends is None and self._borrow(req, n - self._room(req)):  # not preempt
                appends = self._place(req, n)
            while appends is None:
                victim = self._pick_victim(exclude=req, scheduled=segs)
                if victim is None:
                    break
                if victim in queue:
                    queue.remove(victim)
                self._preempt(victim)  # its cached prefix stays, evictable now
                preempted.append(victim)
                appends = self._place_evicting(req, n)
            if appends is None:
                if req.num_computed + n <= self.max_capacity:
                    self._preempt(req)  # others in this step hold the memory: retry later
                else:  # would not fit even alone
                    self.release(req)
                    self.running.remove(req)
                    req.finish("error", MemoryError(
                        f"request {req.req_id}: out of KV memory at {req.num_tokens} tokens "
                        f"(pool capacity {self.max_capacity} tokens)"))
                preempted.append(req)  # its KV must be freed on the nodes either way
                continue
            segs.append(ScheduledSegment(req, req.num_computed, n, appends,
                                         req.num_computed + n == req.num_tokens))
            budget -= n
        while (self.waiting and budget > 0 and len(segs) < max_seqs
               and len(self.running) < max_running):
            req = self.waiting[0]
            hit = self._hit(req)
            n = min(req.num_tokens - req.num_computed, budget)
            appends = self._place_evicting(req, n)
            if (appends is None and req.num_tokens + 1 > self.total_capacity
                    and self._borrow(req, n - self._room(req))):
                appends = self._place(req, n)  # it can never fit in this pool alone
            if appends is None:
                self._unhit(req, hit)
                break  # FIFO: wait for memory
            self._admitted(req, hit)
            self.waiting.popleft()
            req.status = Status.RUNNING
            self.running.append(req)
            segs.append(ScheduledSegment(req, req.num_computed, n, appends,
                                         req.num_computed + n == req.num_tokens))
            budget -= n
        return segs, preempted

    def _pick_victim(self, exclude: Request, scheduled: list[ScheduledSegment]) -> Request | None:
        """The most recently admitted running request not in this step nor in flight in
        another micro-batch (vLLM's policy)."""
        in_step = {s.req.req_id for s in scheduled}
        for req in reversed(self.running):
            if req is not exclude and req.req_id not in in_step and req.req_id not in self._busy:
                return req
        return None

    def _preempt(self, req: Request) -> None:
        self.release(req)
        self.running.remove(req)
        req.status = Status.WAITING
        req.num_preemptions += 1
        self.waiting.appendleft(req)

    def unplace(self, segs: list[ScheduledSegment]) -> None:
        """The step of ``segs`` was dropped before it ran: give back the slots it reserved
        (each request's shards end where its computed KV ends again)."""
        for seg in reversed(segs):
            req = seg.req
            for node, start, count in reversed(seg.appends):
                tail = req.shards[-1] if req.shards else None
                if tail is None or tail.node != node or tail.end != start + count:
                    raise RuntimeError(f"request {req.req_id}: its shards do not end with the "
                                       f"dropped step's appends {seg.appends}")
                tail.length -= count
                self.free[node] += count
                if tail.length == 0:
                    req.shards.pop()

    def preempt(self, req: Request) -> None:
        """Send a running request back to the front of the queue with no KV (recompute); the
        caller frees its KV on the nodes."""
        self._preempt(req)

    def commit(self, segs: list[ScheduledSegment]) -> None:
        """The step ran: the segments' tokens now have KV stored. With a prefix cache, a prefill
        chunk's KV (on the request's first node) is cached at once, for requests admitted
        from now on."""
        for s in segs:
            req = s.req
            req.num_computed = s.start + s.num_tokens
            self.computed_tokens += s.num_tokens
            if self.cache is not None and s.num_tokens > 1 and req.num_cached_tokens is not None:
                first = req.shards[0]
                end = min(req.num_computed, first.end)
                last = self.cache.extend(req.req_id, req.all_ids[:end], first.node,
                                         req.num_cached, req.cache_last)
                if last is not None:
                    req.num_cached, req.cache_last = end, last

    def finish(self, req: Request, reason: str) -> None:
        """End ``req``; with a prefix cache, its KV on its first node (all of it when it ended
        well) is offered to the cache first."""
        if req in self.running:
            self.running.remove(req)
        kept = 0
        # not a request whose KV was written for it (admit_computed: a synthetic context)
        if (self.cache is not None and reason != "error" and req.shards
                and req.num_cached_tokens is not None):
            first = req.shards[0]
            kept = self.cache.insert(req.req_id, req.all_ids[:min(req.num_computed, first.end)],
                                     first.node)
        self.release(req, kept)
        req.finish(reason)
