"""Borrowing protocol with a real Ray gManager actor: stale moves are rejected before any data
moves, concurrent reservations on one creditor are first come first served without
over-commit, a restarted gManager rebuilds its map from full heartbeats, and requests survive
it with unchanged (HF-identical) output."""
import os
import sys

import pytest

ray = pytest.importorskip("ray")

from lamina.config import deployment_config  # noqa: E402
from lamina.deployment.borrowing import (GManager, GManagerClient, Heartbeat,  # noqa: E402
                                         InstanceLoad, MoveCommand, RequestPlacementEntry,
                                         RManager, start_gmanager)
from lamina.deployment.deployment import Deployment  # noqa: E402
from lamina.instance import load_model_info, start_instance  # noqa: E402
from lamina.types import SamplingParams  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "splitter"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "e2e"))
from hf_oracle import hf_greedy  # noqa: E402
from tiny_models import tiny_folder, tiny_model  # noqa: E402

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def ray_session():
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
                 configure_logging=False)
    yield
    if started:
        ray.shutdown()


def _deployment(folder, kv_cache_tokens: int) -> Deployment:
    """Two in-process instances (one memory node each) whose gManager is a Ray actor."""
    config = deployment_config(str(folder), instances=2, memory=1, kv_cache_tokens=kv_cache_tokens,
                               slab_size=8, prefix_caching=False)  # a cached prefix never moves
    info = load_model_info(config)
    instances = [start_instance(config, i, info, None) for i in range(config.instances)]
    return Deployment(instances, config, gmanager="ray")


def _load(inst, batch=1, waiting=0, total=10, used=0):
    return InstanceLoad(inst, batch, waiting, total, used)


def test_heartbeat_deltas_and_resync_local():
    gm = GManager(slab_size=8)
    client = GManagerClient(gm)
    state = {"load": _load(0, used=3), "entries": {7: RequestPlacementEntry(7, 0, 3, True)}}
    rm = RManager(0, client, lambda: (state["load"], dict(state["entries"])))
    rm.beat()
    assert rm.resyncs == 1  # unknown instance: it answered with a full heartbeat
    assert gm.placement[0] == state["entries"]
    state["entries"][8] = RequestPlacementEntry(8, 0, 1, True)
    del state["entries"][7]
    rm.beat()
    assert rm.resyncs == 1
    assert set(gm.placement[0]) == {8}
    with pytest.raises(ValueError, match="entry of instance"):
        gm.heartbeat(Heartbeat(0, _load(0), [RequestPlacementEntry(9, 1, 1, True)]))


@pytest.mark.slow
def test_stale_map_rejects_and_no_data_moves(ray_session, tmp_path):
    """A move planned on an old placement version is refused by the gManager actor, and the
    deployment leaves every node as it was."""
    folder = tiny_folder("llama", tmp_path)
    with _deployment(folder, kv_cache_tokens=64) as d:
        req = d.instances[0].engine.add_request(list(range(3, 30)), GREEDY)
        d.step()  # prefill: the request holds 4 slabs on instance 0
        d.step()
        gm = d.gmanager
        stale = MoveCommand(req.req_id, 0, 1, 2, version=0)
        before = [c.stats().shards for i in d.instances for c in i.nodes]
        assert gm.call("try_move_kvcache", stale) is None
        assert not d.move_kvcache(stale)
        assert [c.stats().shards for i in d.instances for c in i.nodes] == before
        assert gm.call("snapshot")["pending"] == {}
        # the same move with the current version goes through and the request goes on
        current = MoveCommand(req.req_id, 0, 1, 2, gm.call("version_of", req.req_id))
        assert d.move_kvcache(current)
        assert d.instances[1].nodes[0].stats().shards[req.req_id] == (0, 16)
        while d.has_work():
            d.step()
        assert req.error is None and len(req.output_ids) == GREEDY.max_tokens


@pytest.mark.slow
def test_concurrent_reservations_fcfs_without_overcommit(ray_session):
    gm = start_gmanager(slab_size=8)
    ray.get(gm.heartbeat.remote(Heartbeat(1, _load(1, total=10, used=0), full=True)))
    entries = [RequestPlacementEntry(r, 0, 4, True) for r in range(8)]
    ray.get(gm.heartbeat.remote(Heartbeat(0, _load(0, total=40, used=32), entries, full=True)))
    versions = ray.get([gm.version_of.remote(r) for r in range(8)])
    # eight sources' moves of 3 slabs each race for the creditor's 10 free slabs
    refs = [gm.try_move_kvcache.remote(MoveCommand(r, 0, 1, 3, versions[r])) for r in range(8)]
    granted = ray.get(refs)
    assert [g is not None for g in granted] == [True] * 3 + [False] * 5  # in arrival order
    assert ray.get(gm.free_slabs.remote(1)) == 1
    # a reactive borrow gets what is left, then nothing
    res = ray.get(gm.try_borrow.remote(0, 5))
    assert res.dst == 1 and res.num_slabs == 1
    assert ray.get(gm.try_borrow.remote(0, 1)) is None
    # acknowledged reservations move into the creditor's reported use: still no room
    acked = [g.res_id for g in granted if g] + [res.res_id]
    ray.get(gm.heartbeat.remote(Heartbeat(1, _load(1, total=10, used=10), acked=acked)))
    assert ray.get(gm.free_slabs.remote(1)) == 0
    assert ray.get(gm.snapshot.remote())["pending"] == {}
    ray.kill(gm)


@pytest.mark.slow
def test_gmanager_restart_rebuilds_from_full_heartbeats(ray_session, tmp_path):
    """Kill the gManager mid-run; the new one asks every instance to resync, its map equals the
    old one, and every request finishes with the HF output."""
    folder = tiny_folder("llama", tmp_path)
    model = tiny_model("llama")
    model.generation_config.eos_token_id = None
    prompts = [[(5 * s + 11 * j) % 90 + 3 for j in range(n)] for s, n in enumerate((45, 7, 12, 30))]
    want = hf_greedy(model, prompts, GREEDY.max_tokens)
    with _deployment(folder, kv_cache_tokens=40) as d:
        reqs = [d.add_request(p, GREEDY) for p in prompts]
        for _ in range(3):
            d.step()
        assert d.loans  # the 45-token prompt borrowed
        before = d.gmanager.call("snapshot")
        resyncs = [i.rmanager.resyncs for i in d.instances]
        ray.kill(d.gmanager.target)
        d.gmanager.target = start_gmanager(slab_size=8)
        assert d.gmanager.call("snapshot")["placement"] == {}
        d.heartbeat()
        assert [i.rmanager.resyncs for i in d.instances] == [n + 1 for n in resyncs]
        after = d.gmanager.call("snapshot")
        assert after["placement"] == before["placement"] and after["loads"] == before["loads"]
        while d.has_work():
            d.step()
        assert [r.output_ids for r in reqs] == want
        assert all(r.error is None for r in reqs)
