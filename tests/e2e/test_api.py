"""LLM API behaviour on a tiny llama: bad input, seeded sampling, streaming, node failure."""
import os
import time
import signal

import psutil
import pytest

from lamina import LLM, SamplingParams
from lamina.errors import ContextLengthExceeded

from tiny_models import tiny_folder
from live_children import live_children  # noqa: E402

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tiny_folder("llama", tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="module")
def llm(folder):
    with LLM(str(folder), memory=2, kv_cache_tokens=64) as llm:
        yield llm


def test_bad_requests_get_a_clear_value_error_and_the_rest_complete(llm):
    good = [5, 6, 7, 8]
    long = [i % 90 + 1 for i in range(200)]  # 2 nodes x 64 slots hold 128 tokens
    outs = llm.generate([good, [], long, [3, 999999], good], GREEDY, use_tqdm=False)
    assert outs[0].error is None and len(outs[0].outputs[0].token_ids) == 6
    assert outs[4].outputs[0].token_ids == outs[0].outputs[0].token_ids
    assert isinstance(outs[1].error, ValueError) and "empty prompt" in str(outs[1].error)
    assert isinstance(outs[2].error, ValueError)
    assert "does not fit in the KV capacity of all memory nodes" in str(outs[2].error)
    assert isinstance(outs[3].error, ValueError) and "token ids" in str(outs[3].error)
    assert all(o.outputs[0].finish_reason == "error" for o in outs[1:4])
    no_tok = llm.generate(["text needs a tokenizer"], GREEDY, use_tqdm=False)[0]
    assert isinstance(no_tok.error, ValueError) and "no tokenizer" in str(no_tok.error)


def test_max_tokens_past_the_context_is_refused_and_the_rest_complete(llm):
    limit = llm.deployment.instances[0].scheduler.config.max_model_len
    outs = llm.generate([[5, 6, 7], [5, 6, 7]], [SamplingParams(max_tokens=10**30), GREEDY],
                        use_tqdm=False)
    assert isinstance(outs[0].error, ContextLengthExceeded)
    assert f"maximum context length is {limit} tokens" in str(outs[0].error)
    assert "(3 in the prompt, " in str(outs[0].error)
    assert outs[1].error is None and len(outs[1].outputs[0].token_ids) == 6


@pytest.mark.parametrize("bad", [dict(temperature=-1), dict(top_p=0), dict(top_p=1.5),
                                 dict(top_k=-2), dict(max_tokens=0)])
def test_invalid_sampling_params(bad):
    with pytest.raises(ValueError):
        SamplingParams(**bad)


def test_seeded_sampling_is_reproducible_and_independent_of_the_batch(llm):
    p = SamplingParams(temperature=1.0, top_k=20, top_p=0.9, seed=1234, max_tokens=8,
                       ignore_eos=True)
    alone = llm.generate([[9, 8, 7]], p, use_tqdm=False)[0].outputs[0].token_ids
    again = llm.generate([[9, 8, 7]], p, use_tqdm=False)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=1.0, seed=s, max_tokens=8, ignore_eos=True) for s in (1, 2)]
    batched = llm.generate([[1, 2, 3, 4, 5], [9, 8, 7], [4, 4]], [others[0], p, others[1]],
                           use_tqdm=False)[1].outputs[0].token_ids
    assert alone == again == batched
    other_seed = SamplingParams(temperature=1.0, top_k=20, top_p=0.9, seed=99, max_tokens=8,
                                ignore_eos=True)
    assert llm.generate([[9, 8, 7]], other_seed, use_tqdm=False)[0].outputs[0].token_ids != alone


def test_stop_token_ids_and_max_tokens(llm):
    full = llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)[0].outputs[0]
    stop_at = full.token_ids[2]
    first = full.token_ids.index(stop_at)
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=6,
                                                   stop_token_ids=[stop_at]), use_tqdm=False)
    assert out[0].outputs[0].token_ids == full.token_ids[:first + 1]
    assert out[0].outputs[0].finish_reason == "stop" and full.finish_reason == "length"


def test_stream_yields_the_same_tokens_as_generate(llm):
    prompts = [[5, 6, 7], [1, 2, 3, 4, 5, 6, 7, 8]]
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    got = [[], []]
    finished = set()
    for d in llm.generate_stream(prompts, GREEDY):
        got[d.index].extend(d.token_ids)
        if d.finished:
            finished.add(d.index)
            assert d.finish_reason == "length"
    assert got == want and finished == {0, 1}


def _children() -> set[int]:
    return live_children()


def _kill_mid_stream(llm, prompts, params, victim) -> list[list[int]]:
    """Stream ``prompts``; after the first tokens, SIGKILL the pid ``victim(llm)`` returns."""
    got: list[list[int]] = [[] for _ in prompts]
    stream = llm.generate_stream(prompts, params)
    first = next(stream)
    got[first.index] += first.token_ids
    os.kill(victim(llm), signal.SIGKILL)
    for d in stream:
        assert d.finish_reason != "error", d
        got[d.index] += d.token_ids
    return got


@pytest.mark.slow  # starts replica and memory-node processes, twice
@pytest.mark.parametrize("role", ["memory node", "replica"])
def test_a_killed_role_is_replaced_and_no_request_is_lost(folder, role):
    """kill -9 of a memory node or the compute replica mid-generation: that role alone is
    restarted; requests recompute the KV they lost (none for a replica), and every output
    equals the unfaulted one."""
    before = _children()
    prompts = [[1, 2, 3], [4, 5, 6, 7], [8, 9], [10, 11, 12, 13, 14]]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    with LLM(str(folder), memory=2, placement="procs", transport="shm") as llm:
        want = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        inst = llm.deployment.instances[0]
        pids = {"memory node": inst.nodes[1].process.pid,
                "replica": inst.engine.worker.procs[0].pid}
        assert set(pids.values()) <= _children() - before
        got = _kill_mid_stream(llm, prompts, params, lambda _: pids[role])
        assert got == want
        assert llm.deployment.recoveries == 1
        d = llm.deployment
        assert d.instances[0] is inst
        now = {"memory node": inst.nodes[1].process.pid,
               "replica": inst.engine.worker.procs[0].pid}
        assert {r: now[r] != pids[r] for r in pids} == {r: r == role for r in pids}
        assert (d.node_restarts, d.replica_restarts) == ((1, 0) if role == "memory node" else (0, 1))
        again = llm.generate(prompts, params, use_tqdm=False)  # and it keeps serving
        assert [o.outputs[0].token_ids for o in again] == want
    psutil.wait_procs([psutil.Process(p) for p in _children() - before], timeout=10)
    assert _children() - before == set()


@pytest.mark.slow  # starts replica and memory-node processes, three times
def test_when_capacity_is_gone_only_its_requests_fail_and_serving_resumes_when_it_returns(
        folder, monkeypatch):
    """kill -9 of a memory node while no restart can succeed (its host is gone: the restart
    raises): the requests in flight end with an error, new ones are refused with NoCapacity
    (the server's 503 + Retry-After), and once a restart succeeds again the same LLM serves
    the unfaulted greedy output."""
    import lamina.deployment.deployment as deployment
    from lamina.errors import NoCapacity
    monkeypatch.setattr(deployment, "REVIVE_S", 0.2)
    prompts = [[1, 2, 3], [4, 5, 6, 7]]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    with LLM(str(folder), memory=2, placement="procs", transport="shm") as llm:
        want = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        dep = llm.deployment
        real, gone = dep.restart, [True]

        def restart(inst_id):
            if gone[0]:
                raise RuntimeError("no host has lamina_memory resources left")
            return real(inst_id)

        def restart_node(k):  # the node alone cannot come back either
            raise RuntimeError("no host has lamina_memory resources left")

        dep.restart = restart
        dep.instances[0].restart_node = restart_node
        pid = dep.instances[0].nodes[1].process.pid
        stream = llm.generate_stream(prompts, params)
        reasons = {}
        first = next(stream)
        os.kill(pid, signal.SIGKILL)
        for d in [first, *stream]:
            if d.finished:
                reasons[d.index] = (d.finish_reason, d.error)
        assert sorted(reasons) == [0, 1]
        assert all(r == "error" and "memory node" in str(e) for r, e in reasons.values())
        refused = llm.generate(prompts, params, use_tqdm=False)
        assert all(isinstance(o.error, NoCapacity) for o in refused)
        gone[0] = False
        time.sleep(0.3)
        again = llm.generate(prompts, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in again] == want
        assert dep.instances[0].failed is None
