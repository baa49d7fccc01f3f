"""Cluster borrowing keeps greedy output token-identical to HF: a request longer than any single
pool completes by borrowing KV space from other instances' pools (reactive), KV moved between
pools by the gManager's placement (proactive) is attended where it lands, and no request is
lost."""
from dataclasses import replace

import pytest

from lamina import LLM
from lamina.config import deployment_config
from lamina.deployment import Deployment, start_deployment
from lamina.types import SamplingParams

from hf_oracle import hf_greedy
from tiny_models import tiny_folder, tiny_model

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tiny_folder("llama", tmp_path_factory.mktemp("llama"))
    model = tiny_model("llama")
    model.generation_config.eos_token_id = None
    return folder, model


def _prompt(n: int, seed: int) -> list[int]:
    return [(7 * seed + 13 * j + 3) % 90 + 3 for j in range(n)]


def _generate(d: Deployment, prompts: list[list[int]], params: SamplingParams) -> list:
    """Add every prompt (routed by the deployment), step until done; the requests, in order."""
    reqs = [d.add_request(p, params) for p in prompts]
    while d.has_work():
        d.step()
    return reqs


def _no_kv_left(d: Deployment) -> None:
    for inst in d.instances:
        s = inst.scheduler  # every request freed: each pool holds its prefix cache only
        held = s.cache.held if s.cache is not None else [0] * inst.own_nodes
        assert [c.stats().used_slots for c in inst.nodes[:inst.own_nodes]] == held
        assert sum(s.free) + sum(held) == sum(s.capacity)
        assert sum(s.capacity[:inst.own_nodes]) == sum(inst.physical)  # every loan came back


@pytest.mark.parametrize("instances,memory", [(2, 1), (3, 2)])
def test_request_longer_than_any_pool_matches_hf(tiny, instances, memory):
    folder, model = tiny
    # the long request needs about 1.5 pools; the others compete for the rest
    cap = 40
    long = _prompt(int(1.3 * cap * memory), 1)
    prompts = [long, _prompt(9, 2), _prompt(4, 3)]
    want = hf_greedy(model, prompts, GREEDY.max_tokens)
    with LLM(str(folder), instances=instances, memory=memory, kv_cache_tokens=cap,
             slab_size=8) as llm:
        d = llm.deployment
        assert len(long) + GREEDY.max_tokens > cap * memory  # no single pool can hold it
        reqs = _generate(d, prompts, GREEDY)
        assert [r.error for r in reqs] == [None, None, None]
        assert [r.output_ids for r in reqs] == want
        assert reqs[0].max_shards > memory  # its KV really spanned pools
        assert d.loans
        _no_kv_left(d)


def test_without_borrowing_the_long_request_fails_cleanly(tiny):
    folder, _ = tiny
    with LLM(str(folder), instances=2, memory=1, kv_cache_tokens=32, slab_size=8,
             borrowing=False) as llm:
        d = llm.deployment
        assert d.gmanager is None
        with pytest.raises(ValueError, match="does not fit"):
            d.add_request(_prompt(40, 1), GREEDY)
        # a prompt that fits but would grow out of its pool stops there ("length", as at the
        # context limit: max_tokens is capped by the KV capacity); the rest finish
        reqs = _generate(d, [_prompt(28, 1), _prompt(5, 2)],
                         SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
        assert reqs[0].finish_reason == "length" and reqs[0].error is None
        assert len(reqs[0].prompt_ids) + len(reqs[0].output_ids) == 32  # the pool's capacity
        assert reqs[1].error is None and len(reqs[1].output_ids) == 8


@pytest.mark.parametrize("kv_dtype", ["auto", "int8", "k16v8"])
def test_proactive_moves_keep_greedy_output(tiny, kv_dtype):
    """The gManager's greedy placement moves long requests' oldest slabs to the idle instance
    while they decode; outputs still match HF (over the same stored KV for an 8-bit format:
    a move carries the bytes and their scales, it does not quantise again). Without prefix
    caching: a cached prefix is shared, and never moved."""
    from lamina.deployment.borrowing import PerfModel

    folder, model = tiny
    # instance 0 gets long requests (a small batch that fills its pool), instance 1 idles
    perf = PerfModel([1, 8], [1e-3, 2e-3], [8, 64], [1e-5, 4e-5])
    prompts = [_prompt(26, s) for s in range(4)]
    want = hf_greedy(model, prompts, GREEDY.max_tokens,
                     None if kv_dtype == "auto" else kv_dtype)
    config = replace(deployment_config(str(folder), instances=2, memory=1, kv_cache_tokens=96,
                                       slab_size=8, plan_every=2, kv_dtype=kv_dtype,
                                       prefix_caching=False),
                     beta_thres=4, util_thres=0.5)
    with start_deployment(config, perf=perf) as d:
        reqs = [d.instances[0].engine.add_request(p, GREEDY) for p in prompts]
        while d.has_work():
            d.step()
        assert d.moves > 0
        assert [r.output_ids for r in reqs] == want
        _no_kv_left(d)


@pytest.mark.slow  # processes
@pytest.mark.parametrize("victim", ["creditor", "debtor"])
def test_a_dead_node_with_loans_is_restarted_alone(tiny, victim):
    """Under procs, a request of one instance borrows KV space from the other's node; then the
    lending node (``creditor``) or the borrower's own node (``debtor``) is killed mid-
    generation. That node alone is restarted, each instance that had KV on it recomputes only
    its own requests there, no instance restarts, and every request of both completes with
    HF's greedy output; afterwards every loan has come back."""
    import os
    import signal
    folder, model = tiny
    cap = 40
    long = _prompt(int(1.3 * cap), 1)
    prompts = [long, _prompt(9, 2), _prompt(4, 3)]
    want = hf_greedy(model, prompts, GREEDY.max_tokens)
    with LLM(str(folder), instances=2, memory=1, kv_cache_tokens=cap, slab_size=8,
             placement="procs") as llm:
        d = llm.deployment
        before = list(d.instances)
        reqs = [d.add_request(p, GREEDY) for p in prompts]
        while d.has_work() and not d.loans:
            d.step()
        assert d.loans, "the long request never borrowed"
        (loan,) = d.loans.values()
        owner, k = ((loan.creditor, loan.creditor_node) if victim == "creditor"
                    else (loan.debtor, 0))
        os.kill(d.instances[owner].nodes[k].process.pid, signal.SIGKILL)
        while d.has_work():
            d.step()
        assert [r.error for r in reqs] == [None, None, None]
        assert [r.output_ids for r in reqs] == want
        assert (d.node_restarts, d.instance_restarts) == (1, 0)
        assert d.instances == before and d.recomputed_tokens > 0
        _no_kv_left(d)
