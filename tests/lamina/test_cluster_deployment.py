"""Ray-placed instances (``start_deployment`` of a ``placement="ray"`` config, what ``lamina
launch --instances`` runs): every compute replica and memory node a Ray actor of its own. A
request longer than any pool borrows a creditor's node over the wire and matches HF; the
gManager's moves copy KV between node processes while the instances decode and leave outputs
unchanged; a dead memory node or replica is restarted alone (also a node that lent KV space to
the other instance), and a node and a replica dead together restart their instance."""
import os
import sys
from dataclasses import replace

import pytest

ray = pytest.importorskip("ray")

from lamina.config import deployment_config  # noqa: E402
from lamina.deployment import start_deployment  # noqa: E402
from lamina.deployment.borrowing import PerfModel  # noqa: E402
from lamina.types import SamplingParams  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "splitter"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "e2e"))
from hf_oracle import hf_greedy  # noqa: E402
from tiny_models import tiny_folder, tiny_model  # noqa: E402

pytestmark = pytest.mark.slow
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    if ray.is_initialized():
        ray.shutdown()
    ray.init(num_cpus=2, resources={"lamina_compute": 4, "lamina_memory": 8},
             include_dashboard=False, log_to_driver=False, configure_logging=False)
    folder = tiny_folder("llama", tmp_path_factory.mktemp("llama"))
    model = tiny_model("llama")
    model.generation_config.eos_token_id = None
    yield str(folder), model
    ray.shutdown()


def _prompt(n: int, seed: int) -> list[int]:
    return [(7 * seed + 13 * j + 3) % 90 + 3 for j in range(n)]


def _start(folder, *, perf=None, **kw):
    """A deployment of two Ray-placed instances (the module's Ray, which it does not stop)."""
    tuning = {k: kw.pop(k) for k in ("beta_thres", "util_thres") if k in kw}
    config = replace(deployment_config(folder, instances=2, placement="ray", **kw), **tuning)
    return start_deployment(config, perf=perf)


def _run(d, reqs):
    while d.has_work():
        d.step()
    return reqs


def _no_kv_left(d) -> None:
    for inst in d.instances:
        cache = inst.scheduler.cache
        held = cache.held if cache is not None else [0] * inst.own_nodes
        assert [c.stats().used_slots for c in inst.nodes] == held
        s = inst.scheduler
        assert sum(s.capacity[:inst.own_nodes]) == sum(inst.physical)  # every loan came back


def test_remote_borrowing_of_a_request_longer_than_any_pool(tiny):
    folder, model = tiny
    cap = 40
    prompts = [_prompt(52, 1), _prompt(9, 2), _prompt(4, 3)]
    want = hf_greedy(model, prompts, GREEDY.max_tokens)
    d = _start(folder, memory=1, transport="shm", kv_cache_tokens=cap, slab_size=8)
    try:
        assert d.gmanager is not None and d.gmanager.remote  # the gManager is a Ray actor
        reqs = _run(d, [d.add_request(p, GREEDY) for p in prompts])
        assert [r.error for r in reqs] == [None, None, None]
        assert [r.output_ids for r in reqs] == want
        assert reqs[0].max_shards > 1 and d.loans  # its KV spanned two node processes
        _no_kv_left(d)
    finally:
        d.close()


def test_a_lending_node_that_dies_is_restarted_alone(tiny):
    """A request borrows KV space on the other instance's node actor, which is then killed:
    that node alone is restarted, both instances recompute only their KV that was on it, no
    instance restarts, and every request matches HF."""
    folder, model = tiny
    prompts = [_prompt(52, 1), _prompt(9, 2), _prompt(4, 3)]
    want = hf_greedy(model, prompts, GREEDY.max_tokens)
    d = _start(folder, memory=1, transport="shm", kv_cache_tokens=40, slab_size=8)
    try:
        before = list(d.instances)
        reqs = [d.add_request(p, GREEDY) for p in prompts]
        while d.has_work() and not d.loans:
            d.step()
        (loan,) = d.loans.values()
        ray.kill(d.instances[loan.creditor].nodes[loan.creditor_node].process.actor)
        _run(d, reqs)
        assert [r.error for r in reqs] == [None, None, None]
        assert [r.output_ids for r in reqs] == want
        assert (d.node_restarts, d.instance_restarts) == (1, 0) and d.instances == before
        _no_kv_left(d)
    finally:
        d.close()


def test_remote_moves_overlap_decoding_and_keep_output(tiny):
    folder, model = tiny
    perf = PerfModel([1, 8], [1e-3, 2e-3], [8, 64], [1e-5, 4e-5])
    prompts = [_prompt(26, s) for s in range(4)]
    want = hf_greedy(model, prompts, GREEDY.max_tokens)
    d = _start(folder, memory=1, transport="tcp", kv_cache_tokens=96, slab_size=8,
               beta_thres=4, util_thres=0.5, perf=perf, plan_every=2,
               prefix_caching=False)  # a cached prefix is shared, never moved
    try:
        reqs = _run(d, [d.instances[0].engine.add_request(p, GREEDY) for p in prompts])
        assert d.moves > 0
        assert [r.output_ids for r in reqs] == want
        _no_kv_left(d)
    finally:
        d.close()


def test_a_dead_instance_is_restarted_and_its_requests_complete(tiny):
    folder, model = tiny
    prompts = [_prompt(12, s) for s in range(4)]
    want = hf_greedy(model, prompts, GREEDY.max_tokens)
    d = _start(folder, memory=1, kv_cache_tokens=128, slab_size=8, borrowing=False)
    try:
        reqs = [d.add_request(p, GREEDY) for p in prompts]
        assert {r.req_id // (1 << 40) for r in reqs} == {0, 1}  # the router used both
        d.step()
        inst = d.instances[1]
        node = inst.nodes[0].process
        ray.kill(node.actor)  # the memory node's actor dies: it alone is restarted
        _run(d, reqs)
        assert [r.output_ids for r in reqs] == want and all(r.error is None for r in reqs)
        assert d.recoveries == 1 and d.node_restarts == 1 and d.instances[1] is inst
        assert inst.nodes[0].process is not node and inst.nodes[0].process.is_alive()
        later = [d.add_request(p, GREEDY) for p in prompts]  # both instances serve again
        assert {r.req_id // (1 << 40) for r in later} == {0, 1}
        d.step()
        ray.kill(inst.engine.worker.procs[0].actor)  # its replica dies: it alone is restarted
        assert [r.output_ids for r in _run(d, later)] == want
        assert d.recoveries == 2 and d.replica_restarts == 1 and d.instances[1] is inst
        last = [d.add_request(p, GREEDY) for p in prompts]
        d.step()
        ray.kill(inst.nodes[0].process.actor)  # a node and a replica at once: the instance
        ray.kill(inst.engine.worker.procs[0].actor)  # restarts
        assert [r.output_ids for r in _run(d, last)] == want
        assert d.recoveries == 3 and d.instances[1] is not inst
    finally:
        d.close()
