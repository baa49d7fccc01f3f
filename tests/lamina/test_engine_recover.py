"""Engine.recover, the engine's half of restarting only a dead memory node (in process here: the
node is replaced by a fresh one by hand): the step in flight is cancelled on the surviving node,
only the requests that had KV on the lost node recompute (the prefixes cached there are
dropped), and every output equals the unfaulted run's."""
import os
import sys

import pytest

from lamina import LLM, SamplingParams
from lamina.engine.engine import StepOutput
from lamina.memnode import MemoryNode
from lamina.transport.node_client import InProcessNode

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "splitter"))
from tiny_models import tiny_folder  # noqa: E402

PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPTS = [[5, 6, 7], [9, 8, 7, 6, 5, 4], [11, 12], [3, 1, 4, 1, 5]]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tiny_folder("llama", tmp_path_factory.mktemp("llama"))


def test_a_replaced_node_costs_only_its_own_requests_kv(folder):
    with LLM(folder, memory=2, kv_cache_tokens=64, borrowing=False) as llm:
        want = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]
        engine = llm.deployment.instances[0].engine
        reqs = [engine.add_request(p, PARAMS) for p in PROMPTS]
        for _ in range(3):
            engine.step()
        on = {k: [r for r in reqs if any(s.node == k for s in r.shards)] for k in (0, 1)}
        assert on[0] and on[1]  # the requests are spread over both nodes
        cache = engine.scheduler.cache  # the first run's KV, cached on both nodes, was hit
        assert all(h > 0 for h in cache.held) and all(r.num_cached > 0 for r in reqs)
        kept = {r.req_id: r.num_computed for r in on[0] if r not in on[1]}
        out = StepOutput()
        engine.start_step(out)  # a step in flight: prepared on both nodes
        engine._drop_in_flight()  # ... then a node dies (what finish_step does on the error)
        survivor = engine.worker.nodes[0].node
        old = engine.worker.nodes[1].node
        engine.worker.nodes[1] = InProcessNode(MemoryNode(old.specs, 64, kv_dtype=old.pool.fmt.name),
                                               "memory node 1")
        lost = engine.recover({1}, out)
        assert lost > 0
        assert cache.held[1] == 0 and all(c.node == 0 for c in cache.root.children.values())
        assert survivor.in_flight == [] and engine.dropped == []
        shards = survivor.stats().shards
        for r in reqs:  # the survivor holds exactly what the scheduler placed there
            mine = [s for s in r.shards if s.node == 0]
            assert shards.get(r.req_id) == ((mine[0].start, mine[0].length) if mine else None)
        for r in on[1]:
            assert r.num_computed == 0 and r.num_preemptions == 1 and not r.shards
        assert {r.req_id: r.num_computed for r in reqs if r.req_id in kept} == kept
        while engine.has_work():
            engine.step()
        assert [r.output_ids for r in reqs] == want and all(r.error is None for r in reqs)
        assert [n.stats().used_slots for n in engine.worker.nodes] == cache.held
