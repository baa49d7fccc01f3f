"""SlabAllocator: unit tests plus a hypothesis state machine checked against a plain-Python model."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from lamina.memnode.allocator import OutOfSlots, SlabAllocator, SlotError


def snapshot(a: SlabAllocator):
    return (a.num_free, a.num_used, a.used_slabs, a.free_slabs, a.free_full_slabs,
            a.refcount(np.arange(a.capacity)).tolist(), a._stack[: a._top].tolist())


def test_fresh_allocator_hands_out_ascending_slots():
    a = SlabAllocator(10, slab_size=4)
    assert (a.num_slabs, a.num_full_slabs) == (3, 2)  # last slab partial (slots 8, 9)
    assert a.alloc(4).tolist() == [0, 1, 2, 3]
    assert a.alloc(0).tolist() == []
    assert (a.used_slabs, a.free_slabs) == (1, 2)


def test_lifo_reuse_returns_freed_batch_in_order():
    a = SlabAllocator(64, slab_size=8)
    x = a.alloc(10)
    y = a.alloc(5)
    a.free(x)
    assert a.alloc(10).tolist() == x.tolist()  # the same slots, same order
    a.free(y[[3, 1]])
    a.free(y[[0]])
    assert a.alloc(3).tolist() == [y[0], y[3], y[1]]  # last freed first


def test_oom_is_clear_and_changes_nothing():
    a = SlabAllocator(8, slab_size=4)
    a.alloc(5)
    before = snapshot(a)
    with pytest.raises(OutOfSlots) as e:
        a.alloc(4)
    assert isinstance(e.value, MemoryError) and e.value.requested == 4 and e.value.available == 3
    assert "out of KV slots" in str(e.value)
    with pytest.raises(OutOfSlots):
        a.alloc_slabs(1)  # 3 free slots, but no whole free slab
    assert snapshot(a) == before


def test_double_foreign_and_out_of_range_free_raise_without_change():
    a = SlabAllocator(16, slab_size=4)
    x = a.alloc(4)
    a.free(x[:2])
    before = snapshot(a)
    for bad in ([x[0]], [x[2], x[0]], [100], [-1], [x[2], x[2]], [15]):
        with pytest.raises(SlotError):
            a.free(bad)
        assert snapshot(a) == before
    with pytest.raises(SlotError):
        a.fork([x[0]])  # not live
    with pytest.raises(SlotError):
        a.free(np.zeros((2, 2), dtype=np.int64))
    with pytest.raises(SlotError):
        a.free(np.array([1.5]))
    assert snapshot(a) == before


def test_refcounts_keep_shared_slots_alive():
    a = SlabAllocator(8, slab_size=4)
    x = a.alloc(3)
    a.fork(x[:2])
    assert a.refcount(x).tolist() == [2, 2, 1]
    assert a.free(x).tolist() == [x[2]]  # only the unshared slot returns
    assert a.num_used == 2
    assert a.free(torch.tensor(x[:2])).tolist() == x[:2].tolist()  # torch input works
    assert a.num_used == 0
    y = a.alloc(1)
    a.fork([y[0], y[0]])
    a.free([y[0], y[0], y[0]])  # three references, three frees in one call
    assert a.num_used == 0
    a.check_invariants()


def test_alloc_slabs_takes_whole_slabs_and_keeps_free_list_order():
    a = SlabAllocator(18, slab_size=4)  # slabs 0..3 whole, slab 4 partial (16, 17)
    x = a.alloc(6)  # slabs 0 and 1 used
    ids = a.alloc_slabs(2)
    assert ids.tolist() == [2, 3]
    assert a.slab_slots(ids).tolist() == list(range(8, 16))
    assert a.free_full_slabs == 0 and a.free_slabs == 1  # the partial slab is free
    assert a.alloc(2).tolist() == [6, 7]  # free list order unchanged by alloc_slabs
    a.free(a.slab_slots(ids[:1]))
    assert a.free_full_slabs == 1
    a.free(x)
    assert a.free_full_slabs == 2
    a.check_invariants()


def test_zero_capacity():
    a = SlabAllocator(0)
    assert a.num_slabs == 0 and a.alloc(0).size == 0
    with pytest.raises(OutOfSlots):
        a.alloc(1)


class AllocatorMachine(RuleBasedStateMachine):
    """Random alloc/fork/free/alloc_slabs sequences against a model: refcounts and a free stack."""

    @initialize(capacity=st.integers(0, 40), slab_size=st.integers(1, 9))
    def setup(self, capacity, slab_size):
        self.a = SlabAllocator(capacity, slab_size)
        self.cap, self.ss = capacity, slab_size
        self.refs = [0] * capacity
        self.stack = list(range(capacity - 1, -1, -1))  # top at the end

    def live(self):
        return [s for s in range(self.cap) if self.refs[s] > 0]

    @rule(n=st.integers(0, 45))
    def alloc(self, n):
        before = snapshot(self.a)
        if n > len(self.stack):
            with pytest.raises(OutOfSlots):
                self.a.alloc(n)
            assert snapshot(self.a) == before
            return
        got = self.a.alloc(n).tolist()
        want = self.stack[len(self.stack) - n:][::-1]
        del self.stack[len(self.stack) - n:]
        assert got == want  # LIFO: most recently freed first
        for s in got:
            assert self.refs[s] == 0  # never handed out while live
            self.refs[s] = 1

    @rule(n=st.integers(0, 6))
    def alloc_slabs(self, n):
        free_ids = [i for i in range(self.cap // self.ss)
                    if all(self.refs[s] == 0 for s in range(i * self.ss, (i + 1) * self.ss))]
        before = snapshot(self.a)
        if n > len(free_ids):
            with pytest.raises(OutOfSlots):
                self.a.alloc_slabs(n)
            assert snapshot(self.a) == before
            return
        ids = self.a.alloc_slabs(n).tolist()
        assert ids == free_ids[:n]
        taken = {s for i in ids for s in range(i * self.ss, (i + 1) * self.ss)}
        self.stack = [s for s in self.stack if s not in taken]
        for s in taken:
            self.refs[s] = 1

    @precondition(lambda self: any(self.refs))
    @rule(data=st.data())
    def free(self, data):
        live = self.live()
        batch = data.draw(st.lists(st.sampled_from(live), max_size=12))
        counts = {s: batch.count(s) for s in batch}
        if any(c > self.refs[s] for s, c in counts.items()):
            before = snapshot(self.a)
            with pytest.raises(SlotError):
                self.a.free(batch)
            assert snapshot(self.a) == before
            return
        released = self.a.free(np.array(batch, dtype=np.int64)).tolist()
        want = []  # released in the order their counts reach zero (last occurrence)
        for s in batch:
            self.refs[s] -= 1
            if self.refs[s] == 0:
                want.append(s)
        assert released == want
        self.stack.extend(reversed(want))

    @precondition(lambda self: any(self.refs))
    @rule(data=st.data())
    def fork(self, data):
        batch = data.draw(st.lists(st.sampled_from(self.live()), max_size=8))
        self.a.fork(batch)
        for s in batch:
            self.refs[s] += 1

    @rule(data=st.data())
    def bad_free(self, data):
        dead = [s for s in range(self.cap) if self.refs[s] == 0]
        bad = data.draw(st.one_of(st.sampled_from(dead + [-3, self.cap, self.cap + 7])))
        before = snapshot(self.a)
        with pytest.raises(SlotError):
            self.a.free([bad])
        with pytest.raises(SlotError):
            self.a.fork([bad])
        assert snapshot(self.a) == before

    @invariant()
    def accounting(self):
        a = self.a
        a.check_invariants()
        used = sum(1 for r in self.refs if r)
        assert a.num_used == used and a.num_free == len(self.stack)
        assert a.num_used + a.num_free == self.cap
        assert a.refcount(np.arange(self.cap)).tolist() == self.refs
        used_slabs = {s // self.ss for s in range(self.cap) if self.refs[s]}
        assert a.used_slabs == len(used_slabs)
        assert a.used_slabs + a.free_slabs == a.num_slabs == -(-self.cap // self.ss)

    def teardown(self):
        # free everything that is live, once per reference: nothing may leak
        live = [s for s in range(self.cap) for _ in range(self.refs[s])]
        self.a.free(live)
        assert self.a.num_used == 0 and self.a.num_free == self.cap
        assert self.a.free_slabs == self.a.num_slabs


TestAllocatorMachine = AllocatorMachine.TestCase
TestAllocatorMachine.settings = settings(max_examples=100, stateful_step_count=30, deadline=None)


class LongAllocatorMachine(AllocatorMachine):
    pass


TestLongAllocatorMachine = pytest.mark.slow(LongAllocatorMachine.TestCase)
TestLongAllocatorMachine.settings = settings(max_examples=400, stateful_step_count=60,
                                             deadline=None)
