"""MemoryNode driven through PREPARE/ATTEND/FREE/EXPORT/IMPORT, checked against a float64 oracle."""
from __future__ import annotations

import pytest
import torch

from lamina.memnode import MemoryNode, OutOfSlots, RequestBusy, UnknownRequest, UnknownStep
from lamina.types import AttendMsg, AttentionSpec, KVChunk, PrepareMsg, ShardWork

from memnode_harness import Cluster  # tests/memnode is on sys.path (pytest rootdir mode)

H, HKV, D = 6, 2, 8  # GQA: 3 query heads per KV head


def make_specs() -> list[AttentionSpec]:
    s = D ** -0.5
    return [AttentionSpec(layer=0, num_heads=H, num_kv_heads=HKV, head_dim=D, scale=s),
            AttentionSpec(layer=2, num_heads=H, num_kv_heads=HKV, head_dim=D, scale=s, window=5),
            AttentionSpec(layer=5, num_heads=H, num_kv_heads=HKV, head_dim=D, scale=s, window=7,
                          softcap=1.5),
            AttentionSpec(layer=6, num_heads=H, num_kv_heads=HKV, head_dim=D, scale=s,
                          softcap=2.0)]


def make_cluster(*names: str, capacity: int = 96, slab_size: int = 16, seed: int = 0,
                 device: str = "cpu", parts: int = 1) -> Cluster:
    specs = make_specs()
    return Cluster(specs, {n: MemoryNode(specs, capacity, slab_size=slab_size, device=device)
                           for n in names}, seed=seed, parts=parts)


@pytest.mark.parametrize("parts", [1, 2, 3])
def test_prefill_chunks_and_decodes_across_two_nodes_match_oracle(parts):
    """``parts > 1``: every ATTEND goes out as mini-batches of the node's works."""
    c = make_cluster("A", "B", parts=parts)
    c.place = {1: [(0, "A")], 2: [(0, "A")], 3: [(0, "A"), (8, "B")], 4: [(0, "B")]}
    # two micro-batches in flight, layers interleaved between them
    c.run([(1, 0, 6), (2, 0, 3)], [(3, 0, 5)])
    c.run([(1, 6, 4), (2, 3, 1)], [(3, 5, 6)])  # r3's chunk crosses A -> B at position 8
    assert c.holders[3] == {"A", "B"}
    for _ in range(3):
        c.run(c.decode([1, 2]), c.decode([3]))
    c.run(c.decode([1, 2]) + [(4, 0, 7)], c.decode([3]))  # prefill mixed with decodes
    for _ in range(6):  # past every window, so trimming by window is exercised
        c.run(c.decode([1, 2, 4]), c.decode([3]))
    a, b = c.nodes["A"].stats(), c.nodes["B"].stats()
    assert a.shards == {1: (0, 20), 2: (0, 14), 3: (0, 8)}
    assert b.shards == {3: (8, 13), 4: (0, 13)}
    assert a.used_slots == 42 and b.used_slots == 26
    assert a.used_slots + a.free_slots == a.capacity_slots == 96
    assert c.checked_rows > 0
    # FREE everywhere (the engine does not know which node holds what): all slots return
    assert c.nodes["A"].free([1, 2, 3, 4, 99]) == [1, 2, 3]
    assert c.nodes["B"].free([1, 2, 3, 4, 99]) == [3, 4]
    for node in c.nodes.values():
        s = node.stats()
        assert (s.used_slots, s.free_slots, s.used_slabs, s.num_requests) == (0, 96, 0, 0)
        assert s.free_slabs == s.total_slabs == 6 and s.shards == {}
        node.allocator.check_invariants()


def test_queries_before_a_shard_see_nothing_and_merge_exactly():
    c = make_cluster("A", "B")
    c.place = {7: [(0, "A"), (4, "B")]}
    c.run([(7, 0, 9)])  # B's queries at positions 0..3 see no key there: lse = -inf
    c.run(c.decode([7]))


def test_oom_on_prepare_changes_nothing_and_others_continue():
    c = make_cluster("A", capacity=24, slab_size=8)
    c.place = {r: [(0, "A")] for r in (1, 2, 3)}
    c.run([(1, 0, 10), (2, 0, 8)])
    node = c.nodes["A"]
    before = node.stats()
    assert before.free_slots == 6
    with pytest.raises(OutOfSlots) as e:
        c.prepare(c.decode([1]) + [(3, 0, 10)])
    assert isinstance(e.value, MemoryError) and e.value.requested == 11
    assert node.stats() == before and node.in_flight == [] and node.shard(3) is None
    # a plan that fails validation half way through changes nothing either
    with pytest.raises(ValueError):
        node.prepare(PrepareMsg(50, [ShardWork(1, 10, 1, 10, 1), ShardWork(2, 9, 1, 9, 1)]))
    with pytest.raises(UnknownRequest):
        node.prepare(PrepareMsg(51, [ShardWork(1, 10, 1, 10, 1), ShardWork(3, 0, 1)]))
    assert node.stats() == before and node.in_flight == []
    assert 3 not in c.hist_k  # the harness records a step only once every node prepared it
    for _ in range(2):  # the other requests go on
        c.run(c.decode([1, 2]))
    c.run([(3, 0, 2)])  # and a request that fits now is admitted
    assert node.stats().free_slots == 0
    with pytest.raises(OutOfSlots):
        c.prepare(c.decode([3]))
    assert node.free([2]) == [2]
    c.run(c.decode([1, 3]))


def test_export_import_moves_a_shard_and_results_stay_identical():
    c = make_cluster("A", "B", "C", seed=3)
    c.place = {1: [(0, "A")], 2: [(0, "A")]}
    c.run([(1, 0, 9), (2, 0, 10)])
    c.run(c.decode([1, 2]))
    twin = make_specs()
    # whole shard of r1 A -> C while A keeps a copy: the same ATTEND gives the same answer
    chunk = c.nodes["A"].export(1, 0, 10)
    assert chunk.k.shape == (len(twin), 10, HKV, D) and chunk.start_pos == 0
    c.nodes["C"].import_kv(chunk)
    assert c.nodes["C"].stats().shards == {1: (0, 10)}
    g = torch.Generator().manual_seed(9)
    works = [ShardWork(1, q_start=10, num_q=1, append_start=10, num_append=1)]
    for node in (c.nodes["A"], c.nodes["C"]):
        node.prepare(PrepareMsg(1000, works))
    for spec in twin:
        q, k, v = (torch.randn(1, H, D, generator=g), torch.randn(1, HKV, D, generator=g),
                   torch.randn(1, HKV, D, generator=g))
        ra = c.nodes["A"].attend(AttendMsg(1000, spec.layer, q, k, v))
        rc = c.nodes["C"].attend(AttendMsg(1000, spec.layer, q, k, v))
        torch.testing.assert_close(ra.o, rc.o, rtol=0, atol=1e-6)
        torch.testing.assert_close(ra.lse, rc.lse, rtol=0, atol=1e-6)
    for node in (c.nodes["A"], c.nodes["C"]):
        node.free_range(1, 10, 11)  # drop the twin step's token again (suffix free)
    c.nodes["A"].free_range(1, 0, 10)  # complete the move
    c.holders[1] = {"C"}
    c.place[1] = [(0, "C")]
    assert c.nodes["A"].shard(1) is None
    # prefix of r2 A -> B, then the tail [8, 11) A -> C: r2 ends up on three nodes
    c.move(2, "A", "B", 0, 4)
    c.move(2, "A", "C", 8, 11)
    c.place[2] = [(0, "C")]
    assert c.nodes["B"].shard(2) == (0, 4) and c.nodes["A"].shard(2) == (4, 4)
    assert c.nodes["C"].shard(2) == (8, 3)
    for _ in range(3):
        c.run(c.decode([1, 2]))
    # the prefix comes back to A in front of its shard
    c.move(2, "B", "A", 0, 4)
    assert c.nodes["A"].shard(2) == (0, 8) and c.nodes["B"].stats().used_slots == 0
    c.run(c.decode([1, 2]))
    with pytest.raises(ValueError):  # not adjacent to the shard
        c.nodes["A"].import_kv(KVChunk(2, 20, chunk.k[:, :2], chunk.v[:, :2]))
    with pytest.raises(ValueError):  # not a prefix or suffix
        c.nodes["A"].free_range(2, 2, 4)
    with pytest.raises(ValueError):  # wrong shape
        c.nodes["A"].import_kv(KVChunk(9, 0, chunk.k[:2], chunk.v[:2]))


def test_import_oom_changes_nothing():
    specs = make_specs()
    a, b = MemoryNode(specs, 32, slab_size=8), MemoryNode(specs, 8, slab_size=8)
    a.prepare(PrepareMsg(1, [ShardWork(1, 0, 12, 0, 12)]))
    for spec in specs:
        a.attend(AttendMsg(1, spec.layer, torch.randn(12, H, D), torch.randn(12, HKV, D),
                           torch.randn(12, HKV, D)))
    before = b.stats()
    with pytest.raises(OutOfSlots):
        b.import_kv(a.export(1, 0, 12))
    assert b.stats() == before


def test_share_shares_prefix_slots():
    c = make_cluster("A")
    c.place = {1: [(0, "A")], 5: [(0, "A")]}
    c.run([(1, 0, 8)])
    node = c.nodes["A"]
    used = node.stats().used_slots
    node.share(5, [(1, 0, 6)])
    assert node.stats().used_slots == used and node.shard(5) == (0, 6)
    c.holders[5] = {"A"}
    c.hist_k[5] = [k[:6] for k in c.hist_k[1]]
    c.hist_v[5] = [v[:6] for v in c.hist_v[1]]
    c.run([(5, 6, 3)] + c.decode([1]))  # the fork diverges from its parent
    c.run(c.decode([1, 5]))
    assert node.stats().used_slots == used + 2 + 4
    node.free([1])
    assert node.stats().used_slots == 6 + 4  # the shared prefix lives on in r5
    c.run(c.decode([5]))
    node.free([5])
    assert node.stats().used_slots == 0
    node.allocator.check_invariants()


def test_share_chains_entries_and_refuses_bad_parts():
    """A cache entry made of a request's middle positions, then a request built from two
    entries (prefix caching's SHARE); bad parts change nothing."""
    c = make_cluster("A")
    c.place = {1: [(0, "A")]}
    c.run([(1, 0, 10)])
    node = c.nodes["A"]
    node.share(-1, [(1, 0, 4)])
    node.share(-2, [(1, 4, 10)])  # an entry may start past 0
    assert node.shard(-2) == (4, 6)
    node.free([1])
    assert node.stats().used_slots == 10
    before = node.stats()
    for dst, parts in [(7, [(-1, 0, 4), (-2, 5, 8)]),  # not consecutive
                       (7, [(-2, 4, 11)]),  # beyond the entry
                       (7, [(3, 0, 1)]),  # no such shard
                       (-1, [(-2, 5, 6)]),  # dst is held already
                       (7, [])]:
        with pytest.raises((ValueError, LookupError)):
            node.share(dst, parts)
        assert node.stats() == before
    node.share(7, [(-1, 0, 4), (-2, 4, 8)])
    assert node.shard(7) == (0, 8) and node.stats().used_slots == 10
    c.place[7] = [(0, "A")]
    c.holders[7] = {"A"}
    c.hist_k[7] = [k[:8] for k in c.hist_k[1]]
    c.hist_v[7] = [v[:8] for v in c.hist_v[1]]
    c.run([(7, 8, 2)])  # attends over both entries' slots, then its own
    node.free_range(-2, 6, 10)  # evicting an entry's back
    node.free([-1, -2, 7])
    assert node.stats().used_slots == 0
    node.allocator.check_invariants()


def test_free_while_in_flight_is_deferred_and_cancel_rolls_back():
    c = make_cluster("A", capacity=64)
    c.place = {1: [(0, "A")], 2: [(0, "A")]}
    c.run([(1, 0, 5), (2, 0, 4)])
    node = c.nodes["A"]
    before = node.stats()
    # cancel: appends rolled back, the shard a step opened disappears
    node.prepare(PrepareMsg(77, [ShardWork(1, 5, 2, 5, 2), ShardWork(3, 0, 3, 0, 3)]))
    assert node.stats().used_slots == before.used_slots + 5
    with pytest.raises(RequestBusy):
        node.prepare(PrepareMsg(78, [ShardWork(1, 7, 1, 7, 1)]))
    with pytest.raises(RequestBusy):
        node.free_range(1, 0, 1)
    with pytest.raises(ValueError):  # only the written part can be exported
        node.export(1, 0, 7)
    assert node.export(1, 0, 5).k.shape[1] == 5
    node.cancel(77)
    assert node.stats() == before and node.in_flight == []
    with pytest.raises(UnknownStep):
        node.attend(AttendMsg(77, 0, torch.zeros(5, H, D), torch.zeros(5, HKV, D),
                              torch.zeros(5, HKV, D)))
    # free of a busy request: gone at once, its slots come back when the step ends
    p = c.prepare(c.decode([1, 2]))
    assert node.free([2]) == [2]
    assert node.stats().num_requests == 1
    assert node.stats().used_slots == before.used_slots + 2
    for i in range(len(c.specs)):
        c.attend(p, i)  # the in-flight step still computes correctly for both requests
    assert node.stats().used_slots == 6 and node.in_flight == []
    assert node.free([2]) == []  # unknown ids are ignored
    node.free([1])
    assert node.stats().used_slots == 0
    node.allocator.check_invariants()


def test_cancel_steps_rolls_back_what_is_prepared_and_refuses_the_rest_later():
    """Steps dropped in flight when a role died: the one prepared here is rolled back; the one
    whose PREPARE was still on its way is refused when it comes; other steps are untouched."""
    c = make_cluster("A", capacity=64)
    c.place = {1: [(0, "A")], 2: [(0, "A")]}
    c.run([(1, 0, 5), (2, 0, 4)])
    node = c.nodes["A"]
    before = node.stats()
    node.prepare(PrepareMsg(40, [ShardWork(1, 5, 1, 5, 1)]))
    node.cancel_steps([40, 41])
    assert node.stats() == before and node.in_flight == []
    with pytest.raises(UnknownStep, match="cancelled"):
        node.prepare(PrepareMsg(41, [ShardWork(2, 4, 1, 4, 1)]))
    assert node.stats() == before  # refused whole
    node.cancel_steps([41])  # again: nothing changes
    node.prepare(PrepareMsg(42, [ShardWork(2, 4, 1, 4, 1)]))  # a new step of the same request
    assert node.stats().used_slots == before.used_slots + 1
    node.allocator.check_invariants()


def test_prepare_and_attend_validation():
    specs = make_specs()
    node = MemoryNode(specs, 32, slab_size=8)
    bad_plans = [
        [ShardWork(1, 0, 2, 0, 2), ShardWork(1, 2, 1, 2, 1)],  # request twice
        [ShardWork(1, -1, 1, 0, 1)],  # negative position
        [ShardWork(1, 0, 1, 0, 3)],  # appends beyond the last query
        [ShardWork(4, 0, 1)],  # queries for a request the node does not hold
    ]
    for works in bad_plans:
        with pytest.raises((ValueError, UnknownRequest)):
            node.prepare(PrepareMsg(1, works))
    assert node.stats().used_slots == 0
    node.prepare(PrepareMsg(1, [ShardWork(1, 3, 4, 3, 4)]))  # a first shard may open anywhere
    with pytest.raises(ValueError):
        node.prepare(PrepareMsg(1, []))  # step id in use
    q, kv = torch.zeros(4, H, D), torch.zeros(4, HKV, D)
    with pytest.raises(ValueError):
        node.attend(AttendMsg(1, 1, q, kv, kv))  # no spec for layer 1
    with pytest.raises(ValueError):
        node.attend(AttendMsg(1, 0, q[:3], kv, kv))  # wrong q rows
    node.attend(AttendMsg(1, 0, q, kv, kv))
    with pytest.raises(ValueError):
        node.attend(AttendMsg(1, 0, q, kv, kv))  # layer twice
    for spec in specs[1:]:
        node.attend(AttendMsg(1, spec.layer, q, kv, kv))
    assert node.in_flight == [] and node.shard(1) == (3, 4)
    with pytest.raises(ValueError):  # not contiguous with [3, 7)
        node.prepare(PrepareMsg(2, [ShardWork(1, 8, 1, 8, 1)]))
    node.prepare(PrepareMsg(2, []))  # an empty step finishes after its layers too
    for spec in specs:
        r = node.attend(AttendMsg(2, spec.layer, torch.zeros(0, H, D), torch.zeros(0, HKV, D),
                                  torch.zeros(0, HKV, D)))
        assert r.o.shape == (0, H, D) and r.lse.shape == (0, H)
    assert node.in_flight == []
    # store only (no queries: e.g. K/V computed elsewhere), then read back by EXPORT
    node.prepare(PrepareMsg(3, [ShardWork(9, q_start=0, num_q=0, append_start=0, num_append=3)]))
    ks = [torch.randn(3, HKV, D) for _ in specs]
    for spec, k in zip(specs, ks):
        r = node.attend(AttendMsg(3, spec.layer, torch.zeros(0, H, D), k, -k))
        assert r.o.shape == (0, H, D)
    chunk = node.export(9, 0, 3)
    assert torch.equal(chunk.k, torch.stack(ks)) and torch.equal(chunk.v, -torch.stack(ks))
    with pytest.raises(ValueError):
        MemoryNode([specs[0], AttentionSpec(1, 4, 4, D, 1.0)], 8)  # mixed KV shapes


def test_attend_mini_batches_must_continue_the_layer_in_order():
    specs = make_specs()
    node = MemoryNode(specs, 32, slab_size=8)
    works = [ShardWork(1, 0, 3, 0, 3), ShardWork(2, 0, 1, 0, 1), ShardWork(3, 0, 2, 0, 2)]
    node.prepare(PrepareMsg(1, works))
    q, kv = torch.randn(6, H, D), torch.randn(6, HKV, D)
    whole = MemoryNode(specs, 32, slab_size=8)
    whole.prepare(PrepareMsg(1, works))
    want = whole.attend(AttendMsg(1, 0, q, kv, kv))
    for bad in [(1, 2), (0, 0), (0, 4), (2, 1)]:  # not starting at work 0, empty, past the end
        with pytest.raises(ValueError, match="continue"):
            node.attend(AttendMsg(1, 0, q[:0], kv[:0], kv[:0], works=bad))
    with pytest.raises(ValueError, match="expected"):  # works [0, 1) has 3 rows, not 4
        node.attend(AttendMsg(1, 0, q[:4], kv[:4], kv[:4], works=(0, 1)))
    r1 = node.attend(AttendMsg(1, 0, q[:3], kv[:3], kv[:3], works=(0, 1)))
    with pytest.raises(ValueError, match="continue"):  # [0, 1) again
        node.attend(AttendMsg(1, 0, q[:3], kv[:3], kv[:3], works=(0, 1)))
    r2 = node.attend(AttendMsg(1, 0, q[3:], kv[3:], kv[3:], works=(1, 3)))
    assert r1.o.shape[0] == 3 and r2.o.shape[0] == 3
    torch.testing.assert_close(torch.cat([r1.o, r2.o]), want.o)
    torch.testing.assert_close(torch.cat([r1.lse, r2.lse]), want.lse)
    with pytest.raises(ValueError, match="already attended"):
        node.attend(AttendMsg(1, 0, q, kv, kv))
    assert node.in_flight == [1]  # the other layers are still to come
    for spec in specs[1:]:
        node.attend(AttendMsg(1, spec.layer, q[:4], kv[:4], kv[:4], works=(0, 2)))
        node.attend(AttendMsg(1, spec.layer, q[4:], kv[4:], kv[4:], works=(2, 3)))
    assert node.in_flight == [] and node.shard(3) == (0, 2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_nodes_on_cuda_match_oracle():
    c = make_cluster("A", "B", device="cuda")
    c.place = {1: [(0, "A"), (6, "B")], 2: [(0, "B")]}
    c.run([(1, 0, 9), (2, 0, 4)])
    for _ in range(8):
        c.run(c.decode([1, 2]))
    c.move(2, "B", "A", 0, 12)
    c.place[2] = [(0, "A")]
    c.run(c.decode([1, 2]))


def test_a_kv_format_the_kernel_cannot_read_is_refused_at_start(kernels):
    """8-bit KV runs on the C++ kernel (and the reference); a node on another kernel says so
    before it holds anything, as does a format name that does not exist."""
    from lamina.config import deployment_config
    spec = AttentionSpec(layer=0, num_heads=4, num_kv_heads=2, head_dim=16, scale=0.25)
    kernels("torch")
    with pytest.raises(ValueError, match="kv_dtype int8: the torch attention kernel"):
        MemoryNode([spec], 32, kv_dtype="int8")
    assert MemoryNode([spec], 32, kv_dtype="bfloat16").pool.fmt.name == "bfloat16"
    kernels("ref")
    assert MemoryNode([spec], 32, kv_dtype="k16v8").pool.v_scale.shape == (1, 32, 2)
    with pytest.raises(ValueError, match="kv_dtype 'int4'"):
        deployment_config("smollm2", kv_dtype="int4")


@pytest.mark.parametrize("attention", ["cpp", "torch"])
@pytest.mark.parametrize("parts", [1, 2])
def test_requests_on_one_cached_prefix_read_it_once_and_match_oracle(parts, attention, kernels,
                                                                      monkeypatch):
    """Requests whose shards start on the same slots (prefix caching's SHARE) form a cascade
    group: the shared keys are attended once for all of them and merged by LSE (whole-step
    ATTENDs on layers without a window); mini-batches and windowed layers read them per
    request. Every result matches the oracle."""
    import lamina.memnode.cascade as cascade_mod
    import lamina.memnode.node as node_mod
    calls = []
    monkeypatch.setattr(cascade_mod, "MIN_SHARED", 16)  # this test's prefixes are short
    monkeypatch.setattr(cascade_mod, "MIN_SAVED", 0)

    def counting(*args, **kw):
        calls.append(args[7].rows.numel())  # the grouped query rows
        return node_mod.attend_cascade.__wrapped__(*args, **kw)
    counting.__wrapped__ = node_mod.attend_cascade
    monkeypatch.setattr(node_mod, "attend_cascade", counting)
    kernels(attention)  # the cascade calls whatever kernel the node resolved
    c = make_cluster("A", capacity=200, parts=parts)
    c.place = {r: [(0, "A")] for r in range(1, 6)}
    c.run([(1, 0, 40)])
    node = c.nodes["A"]
    node.share(-1, [(1, 0, 40)])  # a cache entry of request 1's prompt
    for r, n in ((2, 32), (3, 40), (4, 20)):
        node.share(r, [(-1, 0, n)])
        c.holders[r] = {"A"}
        c.hist_k[r] = [k[:n] for k in c.hist_k[1]]
        c.hist_v[r] = [v[:n] for v in c.hist_v[1]]
    c.run([(2, 32, 3), (3, 40, 1), (4, 20, 2)] + c.decode([1]) + [(5, 0, 4)])
    for _ in range(3):
        c.run(c.decode([1, 2, 3, 4, 5]))
    if parts == 1:  # each step's unwindowed layers; 4 requests x 1..3 queries grouped
        layers = sum(s.window is None for s in c.specs)
        assert layers and calls == [3 + 1 + 2 + 1] * layers + [4] * 3 * layers
    else:
        assert calls == []
