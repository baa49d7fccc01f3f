"""LLM API behaviour on a tiny llama: bad input, seeded sampling, streaming, node failure."""
import os
import signal

import psutil
import pytest

from lamina import LLM, SamplingParams
from lamina.errors import NodeFailure

from tiny_models import tiny_folder

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
    return {p.pid for p in psutil.Process().children(recursive=True)
            if "resource_tracker" not in " ".join(p.cmdline())}


@pytest.mark.slow  # starts a replica process and two memory-node processes
def test_killed_memory_node_gives_a_clear_error_and_leaves_no_orphans(folder):
    before = _children()
    llm = LLM(str(folder), memory=2, placement="procs", transport="shm")
    pids = [c.process.pid for c in llm.deployment.instances[0].nodes]
    assert set(pids) <= _children() - before
    stream = llm.generate_stream([[1, 2, 3]] * 4, SamplingParams(temperature=0, max_tokens=50,
                                                                 ignore_eos=True))
    next(stream)
    os.kill(pids[1], signal.SIGKILL)
    # seen first by the engine (which knows its pid) or by the replica attending over it
    with pytest.raises(NodeFailure, match=rf"memory node 1 (\(pid {pids[1]}\) died|is gone)"):
        for _ in stream:
            pass
    with pytest.raises(RuntimeError, match="this LLM is closed"):
        llm.generate([[1, 2]], GREEDY, use_tqdm=False)
    llm.close()
    psutil.wait_procs([psutil.Process(p) for p in _children() - before], timeout=10)
    assert _children() - before == set()
