"""The prefix cache's radix tree (lamina.engine.prefix_cache) against a model of the memory nodes
that applies its ops, and the scheduler with a cache: hits, eviction before preemption, and
the slot accounting."""
from __future__ import annotations

import random

import pytest

from lamina.config import SchedulerConfig
from lamina.engine.prefix_cache import Drop, PrefixCache, Share
from lamina.engine.request import Request
from lamina.engine.scheduler import Scheduler
from lamina.types import SamplingParams


class FakeNodes:
    """Shards as lists of what each position's KV depends on (the tokens up to it), with the
    memory node's rules for SHARE (consecutive parts into a new shard) and for freeing a
    range (a suffix or all)."""

    def __init__(self):
        self.shards: dict[tuple[int, int], tuple[int, list]] = {}  # (node, id) -> (start, kv)

    def write(self, node: int, req: int, tokens: list[int]) -> None:
        self.shards[node, req] = (0, [tuple(tokens[:i + 1]) for i in range(len(tokens))])

    def apply(self, ops) -> None:
        for op in ops:
            if isinstance(op, Share):
                kv = []
                for i, (src, a, b) in enumerate(op.parts):
                    start, skv = self.shards[op.node, src]
                    assert start <= a < b <= start + len(skv)
                    assert i == 0 or a == op.parts[i - 1][2]
                    kv += skv[a - start:b - start]
                assert (op.node, op.dst) not in self.shards
                self.shards[op.node, op.dst] = (op.parts[0][1], kv)
            else:
                assert isinstance(op, Drop)
                start, kv = self.shards[op.node, op.entry]
                end = start + len(kv)
                assert op.end == end and start <= op.start < end  # the back, or all of it
                if op.start == start:
                    del self.shards[op.node, op.entry]
                else:
                    del kv[op.start - start:]

    def entry_slots(self, node: int) -> int:
        return sum(len(kv) for (n, i), (_, kv) in self.shards.items() if n == node and i < 0)


def test_hit_split_and_evict_in_lru_order():
    c, nodes = PrefixCache(1), FakeNodes()
    a = [1, 2, 3, 4, 5, 6, 7, 8]
    assert c.attach(10, a) is None
    nodes.write(0, 10, a)
    assert c.insert(10, a, 0) == 8 and c.held == [8]
    b = [1, 2, 3, 4, 9, 9]
    hit = c.attach(11, b + [0])
    assert hit.length == 4 and hit.share.parts == [(-1, 0, 4)]  # b's first 4 tokens
    c.commit(hit, 7)
    nodes.apply(c.take_ops())
    nodes.shards[0, 11][1].extend(tuple(b[:i + 1]) for i in range(4, 6))
    assert c.insert(11, b, 0) == 2  # splits a's edge at 4
    nodes.apply(c.take_ops())
    c.release(hit.last)
    assert c.held == [10] and nodes.entry_slots(0) == 10
    hit = c.attach(12, b + [5])  # both entries, one Share
    assert hit.length == 6 and hit.share.parts == [(-1, 0, 4), (-2, 4, 6)]
    c.release(hit.last)
    # LRU: a's tail [4, 8) was used least recently, then b's tail, then the shared [0, 4)
    assert c.evict(1) == [(0, 4)]
    assert c.evict(1) == [(0, 2)]
    assert c.evict(100) == [(0, 4)]
    nodes.apply(c.take_ops())
    assert c.held == [0] and nodes.entry_slots(0) == 0


def test_locked_paths_stay_and_other_nodes_do_not_extend_a_path():
    c = PrefixCache(2)
    c.insert(1, [5, 6, 7], 0)
    hit = c.attach(2, [5, 6, 7, 8])
    assert c.evict(10) == []
    assert c.insert(3, [5, 6, 7, 8, 9], 1) == 0  # known part on node 0: not cached on node 1
    assert c.insert(4, [5, 9], 2) == 0  # a borrowed node (index past the own ones)
    c.release(hit.last)
    c.insert(5, [6, 6], 1)
    assert c.drop_node(0) == 3 and c.held == [0, 2]
    assert c.attach(6, [5, 6, 7, 8]) is None and c.attach(7, [6, 6, 1]).length == 2


def test_random_traffic_keeps_every_shared_position_exact():
    """Requests share random prefixes; each one's KV as the fake nodes hold it after its hit
    must be exactly what its own tokens make, and the tree's count must match the nodes'."""
    rng = random.Random(0)
    c, nodes = PrefixCache(2), FakeNodes()
    stems = [[rng.randrange(4) for _ in range(rng.randrange(1, 12))] for _ in range(6)]
    held: dict[int, tuple] = {}
    for rid in range(1, 300):
        tokens = rng.choice(stems)[:rng.randrange(1, 12)] + \
            [rng.randrange(4) for _ in range(rng.randrange(0, 6))]
        tokens = tokens or [0]
        node = rng.randrange(2)
        hit = c.attach(rid, tokens)
        if hit is not None:
            c.commit(hit, len(tokens))
            node = hit.node
            nodes.apply(c.take_ops())
            start, kv = nodes.shards[node, rid]
            assert start == 0 and kv == [tuple(tokens[:i + 1]) for i in range(hit.length)]
            kv.extend(tuple(tokens[:i + 1]) for i in range(hit.length, len(tokens)))
            held[rid] = hit.last
        else:
            nodes.write(node, rid, tokens)
        if rng.random() < 0.7:  # it finishes: its KV is offered to the cache, then freed
            c.insert(rid, tokens, node)
            nodes.apply(c.take_ops())
            del nodes.shards[node, rid]
            if rid in held:
                c.release(held.pop(rid))
        if rng.random() < 0.2:
            c.evict(rng.randrange(1, 20))
            nodes.apply(c.take_ops())
        assert c.held == [nodes.entry_slots(0), nodes.entry_slots(1)]
    for last in held.values():
        c.release(last)
    c.evict(10 ** 6)
    nodes.apply(c.take_ops())
    assert c.held == [0, 0] and nodes.entry_slots(0) == nodes.entry_slots(1) == 0


GREEDY = SamplingParams(temperature=0, max_tokens=4)


def _run(s: Scheduler, reqs: list[Request]) -> None:
    """Drive requests to the end: each step's tokens are computed, the sampled ones decoded."""
    for r in reqs:
        s.add(r)
    for _ in range(1000):
        if not s.has_work():
            return
        segs, _ = s.schedule()
        s.commit(segs)
        for seg in segs:
            if seg.sample:
                seg.req.output_ids.append(7)
                if len(seg.req.output_ids) == seg.req.params.max_tokens:
                    s.finish(seg.req, "length")
        held = sum(s.cache.held)
        owned = sum(sum(sh.length for sh in r.shards) - r.num_cached for r in s.running)
        assert sum(s.free) + held + owned == sum(s.capacity)
    raise AssertionError("the requests did not finish")


def test_scheduler_hits_skip_prefill_and_evicts_before_preempting():
    s = Scheduler([64], SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64),
                  cache=PrefixCache(1))
    prefix = list(range(100, 130))
    first = Request(0, prefix + [1], GREEDY)
    _run(s, [first])
    assert first.num_cached_tokens == 0 and s.cache.held == [34]  # 31 + 3 decoded
    second = Request(1, prefix + [2, 3], GREEDY)
    s.add(second)
    segs, _ = s.schedule()
    assert segs[0].start == 30 and segs[0].num_tokens == 2  # only the suffix is computed
    assert second.num_cached == second.num_cached_tokens == 30
    s.commit(segs)
    _run(s, [])
    # a request that needs the whole pool: the cache is evicted, nothing is preempted
    big = Request(2, list(range(200, 260)), GREEDY)
    _run(s, [big])
    assert big.num_preemptions == 0 and big.finish_reason == "length"
    assert s.cache.held == [63]


def test_a_prefill_chunk_is_cached_for_requests_admitted_after_it():
    """Chunked prefill: the second request, admitted while the first is still prefilling,
    starts on the chunks already computed; the first holds them as its cached prefix."""
    s = Scheduler([256], SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16),
                  cache=PrefixCache(1))
    prompt = list(range(100, 140))
    a, b = Request(0, prompt + [1], GREEDY), Request(1, prompt + [2], GREEDY)
    s.add(a)
    for _ in range(2):  # two chunks of a: 32 positions computed and cached
        segs, _ = s.schedule()
        s.commit(segs)
    assert a.num_cached == 32 and s.cache.held == [32]
    s.add(b)
    segs, _ = s.schedule()  # a's last 9 tokens, then b's first 7 beyond the cached 32
    assert [(g.req.req_id, g.start, g.num_tokens) for g in segs] == [(0, 32, 9), (1, 32, 7)]
    assert b.num_cached_tokens == 32
    s.commit(segs)
    assert a.num_cached == 41 and b.num_cached == 32  # b's chunk extends nothing: a has it
    _run(s, [])
    assert a.finish_reason == b.finish_reason == "length"
    assert s.free[0] + s.cache.held[0] == 256


def test_cached_prefixes_give_way_to_lending_on_their_node_only():
    """A pool lending slots evicts its unused cached prefixes on that node (a creditor whose
    cache filled its pool would otherwise lend nothing, and a borrower wait forever)."""
    s = Scheduler([32, 32], SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64),
                  cache=PrefixCache(2))
    s.free = [0, 0]  # every slot used: half by cached prefixes, one of them in use
    s.cache.insert(1, list(range(10)), 0)
    s.cache.insert(2, list(range(50, 60)), 1)
    s.cache.insert(3, list(range(70, 76)), 0)
    hit = s.cache.attach(4, list(range(70, 77)))
    assert [s.reclaimable(k) for k in (0, 1)] == [10, 10]
    s.reclaim(0, 8)
    assert s.free == [10, 0] and s.cache.held == [6, 10]
    assert [type(op).__name__ for op in s.cache.take_ops()] == ["Share"] * 3 + ["Drop"]
    s.reclaim(0, 20)  # the rest is in use
    assert s.free == [10, 0]
    s.cache.release(hit.last)
