"""Scheduler: continuous batching, chunked prefill, placement across nodes, preemption."""
import pytest

from lamina.engine.request import Request, Status
from lamina.config import SchedulerConfig
from lamina.engine.scheduler import Scheduler
from lamina.errors import ContextLengthExceeded
from lamina.types import SamplingParams


def req(i, n, max_tokens=4):
    return Request(i, list(range(1, n + 1)), SamplingParams(temperature=0, max_tokens=max_tokens))


def run_step(s, segs, token=7):
    """Pretend the step ran: commit and append a sampled token where one is due."""
    s.commit(segs)
    for seg in segs:
        if seg.sample:
            seg.req.output_ids.append(token)


def test_chunked_prefill_respects_the_token_budget_fifo():
    s = Scheduler([1000], SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=10))
    a, b = req(0, 7), req(1, 6)
    s.add(a), s.add(b)
    segs, _ = s.schedule()
    assert [(g.req.req_id, g.start, g.num_tokens, g.sample) for g in segs] == \
        [(0, 0, 7, True), (1, 0, 3, False)]
    run_step(s, segs)
    segs, _ = s.schedule()  # a decodes (1 token), b continues its prefill
    assert [(g.req.req_id, g.start, g.num_tokens, g.sample) for g in segs] == \
        [(0, 7, 1, True), (1, 3, 3, True)]


def test_max_num_seqs():
    s = Scheduler([1000], SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=100))
    for i in range(3):
        s.add(req(i, 3))
    segs, _ = s.schedule()
    assert [g.req.req_id for g in segs] == [0, 1] and len(s.waiting) == 1


def test_request_outgrows_a_node_and_opens_a_shard_on_the_freest_other_node():
    s = Scheduler([5, 3, 8], SchedulerConfig(max_num_batched_tokens=100))
    r = req(0, 14)
    s.add(r)
    segs, _ = s.schedule()
    # most free first (node 2: 8 slots), then node 0 (5), then node 1 (1 of 3)
    assert segs[0].appends == [(2, 0, 8), (0, 8, 5), (1, 13, 1)]
    assert [(x.node, x.start, x.length) for x in r.shards] == [(2, 0, 8), (0, 8, 5), (1, 13, 1)]
    assert s.free == [0, 2, 0]


def test_too_long_and_empty_prompts_are_rejected():
    s = Scheduler([4, 4], SchedulerConfig(max_model_len=100))
    with pytest.raises(ValueError, match="does not fit in the KV capacity of all memory nodes"):
        s.add(req(0, 8))
    with pytest.raises(ValueError, match="empty prompt"):
        s.add(Request(1, [], SamplingParams()))
    assert not s.has_work()


def test_max_tokens_past_the_context_is_refused():
    s = Scheduler([400], SchedulerConfig(max_model_len=100))
    with pytest.raises(ContextLengthExceeded, match=r"maximum context length is 100 tokens, but "
                       r"10\d{29} were requested \(8 in the prompt, 10\d{29} in max_tokens\)"):
        s.add(req(0, 8, max_tokens=10**30))
    with pytest.raises(ContextLengthExceeded, match=r"101 were requested"):
        s.add(req(1, 8, max_tokens=93))
    s.add(req(2, 8, max_tokens=92))  # exactly the context
    assert len(s.waiting) == 1


def test_preemption_recomputes_and_loses_nothing():
    s = Scheduler([10], SchedulerConfig(max_num_batched_tokens=100))
    a, b = req(0, 5, max_tokens=20), req(1, 4, max_tokens=20)
    s.add(a), s.add(b)
    segs, _ = s.schedule()
    run_step(s, segs)  # 9 slots used; a has 6 tokens, b 5
    segs, pre = s.schedule()  # a takes the 10th slot; b cannot grow and is preempted
    assert [g.req.req_id for g in segs] == [0] and pre == [b]
    assert b.status is Status.WAITING and b.num_computed == 0 and b.num_preemptions == 1
    assert b.output_ids == [7] and not b.finished  # kept: recomputed later, not resampled
    assert s.free == [4]  # b's slots came back; b (5 tokens to recompute) does not fit yet
    run_step(s, segs)
    s.finish(a, "length")
    segs, _ = s.schedule()  # b is re-admitted and recomputes prompt + its output so far
    assert [(g.req.req_id, g.start, g.num_tokens, g.sample) for g in segs] == [(1, 0, 5, True)]


def test_unplace_gives_back_a_dropped_step_s_reservations():
    """A step dropped in flight (a role died): its appends leave the shards and the free counts
    as before it was scheduled, also where it had opened a shard on a second node."""
    s = Scheduler([6, 6], SchedulerConfig(max_num_batched_tokens=100))
    a, b = req(0, 5, max_tokens=20), req(1, 2, max_tokens=20)
    s.add(a), s.add(b)
    run_step(s, s.schedule()[0])  # a: 6 tokens, 5 stored on node 0; b: 3, 2 on node 1
    shards = [[(x.node, x.start, x.length) for x in r.shards] for r in (a, b)]
    free = list(s.free)
    segs, _ = s.schedule()  # a stores position 5 on node 0; b position 2 on node 1
    assert s.free != free
    s.unplace(segs)
    assert s.free == free and [[(x.node, x.start, x.length) for x in r.shards]
                               for r in (a, b)] == shards
    s.free[0] = 0  # node 0 full: a's next position opens a shard on node 1
    segs, _ = s.schedule()
    assert [x.node for x in a.shards] == [0, 1]
    s.unplace(segs)
    assert [x.node for x in a.shards] == [0] and s.free == [0, free[1]]
    with pytest.raises(RuntimeError, match="do not end"):
        s.unplace(segs)  # twice: the shards no longer end with those appends


def test_victim_is_the_latest_running_request_not_in_the_step():
    s = Scheduler([12], SchedulerConfig(max_num_batched_tokens=100))
    a, b = req(0, 3, max_tokens=20), req(1, 3, max_tokens=20)
    s.add(a), s.add(b)
    run_step(s, s.schedule()[0])  # 6 used; a and b have 4 tokens
    c = req(2, 2, max_tokens=20)
    s.add(c)
    run_step(s, s.schedule()[0])  # a, b decode (8 used), c prefills 2 (10 used)
    run_step(s, s.schedule()[0])  # 13 needed > 12: c (latest) is preempted
    assert c.status is Status.WAITING and c.num_preemptions == 1
    assert a.status is Status.RUNNING and b.status is Status.RUNNING


def test_a_request_alone_that_cannot_grow_fails_clearly():
    s = Scheduler([6], SchedulerConfig(max_num_batched_tokens=100))
    a = req(0, 5, max_tokens=10)
    s.add(a)
    segs, _ = s.schedule()
    run_step(s, segs)
    segs, _ = s.schedule()
    run_step(s, segs)  # 6 slots used
    segs, pre = s.schedule()
    assert segs == [] and pre == [a]
    assert a.finished and a.finish_reason == "error" and "out of KV memory" in str(a.error)
    assert s.free == [6]


def test_admit_computed_starts_a_request_past_its_prefill():
    """Synthetic contexts (benchmarks): n positions placed and counted as computed; the next
    step decodes the last prompt token; what does not fit stays waiting, untouched."""
    s = Scheduler([40, 40], SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64))
    a, b = req(0, 50), req(1, 60)
    s.add(a), s.add(b)
    appends = s.admit_computed(a, 49)
    assert a.status == Status.RUNNING and a.num_computed == 49 and a not in s.waiting
    assert sum(c for _, _, c in appends) == 49 and sum(s.free) == 80 - 49
    with pytest.raises(ValueError, match="do not fit"):
        s.admit_computed(b, 59)
    assert b in s.waiting and b.num_computed == 0 and sum(s.free) == 80 - 49
    with pytest.raises(ValueError, match="cannot admit"):
        s.admit_computed(a, 10)  # running already
    segs, _ = s.schedule()
    assert [(g.req.req_id, g.start, g.num_tokens, g.sample) for g in segs][0] == (0, 49, 1, True)
