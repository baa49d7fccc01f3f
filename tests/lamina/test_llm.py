"""``LLM`` as a caller meets it: it leaves the calling process as it found it (CPU affinity,
torch threads), and a script that starts role processes without a main guard gets one sentence
naming the fix."""
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from lamina import LLM, SamplingParams, stages
from lamina.device import available_cores
from lamina.instance.launcher import UNGUARDED_MAIN

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "splitter"))
from tiny_models import tiny_folder  # noqa: E402


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tiny_folder("llama", tmp_path_factory.mktemp("llama"))


def _caller() -> tuple[set[int], int]:
    return set(os.sched_getaffinity(0)), torch.get_num_threads()


@pytest.mark.skipif(len(available_cores()) < 2, reason="needs two cores to pin to")
def test_an_in_process_llm_gives_its_caller_back_its_cores_and_threads(folder):
    cores = available_cores()
    before = _caller()
    ids, greedy = [5, 6, 7], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    with LLM(folder, device=f"cpu:{cores[0]}", memory_device=f"cpu:{cores[0]}",
             kv_cache_tokens=64) as llm:
        assert _caller() == ({cores[0]}, 1)  # the roles own the core while the LLM lives
        first = llm.generate([ids], greedy, use_tqdm=False)[0].outputs[0].token_ids
    assert _caller() == before
    # created again on another core, in the same process
    with LLM(folder, device=f"cpu:{cores[1]}", memory_device=f"cpu:{cores[1]}",
             kv_cache_tokens=64) as llm:
        assert _caller() == ({cores[1]}, 1)
        assert llm.generate([ids], greedy, use_tqdm=False)[0].outputs[0].token_ids == first
    assert _caller() == before


@pytest.mark.skipif(len(available_cores()) < 2, reason="needs two cores to pin to")
def test_a_failed_start_gives_the_caller_back_its_cores(folder, monkeypatch):
    import lamina.instance as instance

    def refuse(*a, **k):
        raise RuntimeError("no memory node today")

    before = _caller()
    monkeypatch.setattr(instance, "MemoryNode", refuse)
    core = available_cores()[0]
    with pytest.raises(RuntimeError, match="no memory node today"):
        LLM(folder, device=f"cpu:{core}", memory_device=f"cpu:{core}", kv_cache_tokens=64)
    assert _caller() == before


@pytest.mark.slow  # two Python processes import torch
def test_a_script_without_a_main_guard_gets_one_sentence_naming_the_fix(folder, tmp_path):
    script = tmp_path / "unguarded.py"
    script.write_text(textwrap.dedent(f"""
        from lamina import LLM, SamplingParams
        llm = LLM({folder!r}, memory=1, placement="procs", kv_cache_tokens=64)
        print("started")
    """))
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                       cwd=tmp_path)
    assert r.returncode != 0 and "started" not in r.stdout
    last = r.stderr.strip().splitlines()[-1]
    assert last == f"RuntimeError: {UNGUARDED_MAIN}"
    assert 'if __name__ == "__main__":' in last
    assert "bootstrapping" not in r.stderr and "Traceback" in r.stderr  # no child's riddle
    assert r.stderr.count("Traceback") == 1


def test_kernel_choices_are_config_carried_to_every_role_and_given_back(folder):
    from lamina.config import KernelConfig, deployment_config, kernels_in_use
    from lamina.memnode.server import node_config

    before = kernels_in_use()
    cfg = deployment_config(folder, kernels="torch")
    assert cfg.instance.kernels == KernelConfig("torch", "torch", "python", "python", "fx")
    with pytest.raises(ValueError, match="expected one of"):
        deployment_config(folder, kernels="fastest")
    with pytest.raises(ValueError, match="ring kernels 'zmq'"):
        KernelConfig(ring="zmq")
    assert node_config([], 8, "cpu", torch.float32, 4, kernels=cfg.instance.kernels).kernels \
        == {"attention": "torch", "linear": "torch", "ring": "python", "plane": "python",
            "slices": "fx"}
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    outs = {}
    stages.take()
    for name in ("auto", "torch"):
        with LLM(folder, kv_cache_tokens=64, kernels=name) as llm:
            if name == "auto":  # where an in-process start's seconds went (lamina.stages)
                assert {"memory nodes", "compute replicas"} <= set(stages.take())
            assert kernels_in_use() == KernelConfig.named(name)
            outs[name] = llm.generate([[5, 6, 7]], greedy, use_tqdm=False)[0].outputs[0].token_ids
        assert kernels_in_use() == before
    assert outs["auto"] == outs["torch"]


@pytest.mark.slow  # starts role processes
def test_role_processes_compute_with_their_instance_kernels(folder):
    from lamina.config import KernelConfig

    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    with LLM(folder, kv_cache_tokens=64, placement="procs", memory=1,
             kernels=KernelConfig(attention="ref", linear="torch", ring="python")) as llm:
        started = stages.take()  # each role's start, with its own stages (lamina.stages)
        assert {"roles", "replica 0: start", "memory node 0: start",
                "memory node 0: build node", "replica 0: replica"} <= set(started)
        node = llm.deployment.instances[0].nodes[0]
        assert node.ch._writer is None  # the engine's ring to the node: the Python codec
        ref = llm.generate([[5, 6, 7]], greedy, use_tqdm=False)[0].outputs[0].token_ids
    with LLM(folder, kv_cache_tokens=64) as llm:
        assert llm.generate([[5, 6, 7]], greedy, use_tqdm=False)[0].outputs[0].token_ids == ref


def test_a_request_finished_in_the_failing_step_stays_readable_after_a_restart(folder):
    """A request may finish in the very deployment step whose failure (another micro-batch's
    node died) restarts its instance: its caller still reads it afterwards, until it forgets
    it (LLM.generate's stream once failed on it with ``'NoneType' ... 'finished'``)."""
    with LLM(folder, kv_cache_tokens=64) as llm:
        d = llm.deployment
        req = d.add_request([5, 6, 7], SamplingParams(temperature=0, max_tokens=2,
                                                      ignore_eos=True))
        while not req.finished:
            d.step()
        inst = d.instances[0]
        inst.close()
        d._install(inst, d.restart(inst.inst_id), [])  # what a recovery does
        assert d.request(req.req_id) is req
        d.forget(req.req_id)
        assert d.request(req.req_id) is None


def test_an_unexpected_step_error_ends_the_running_requests_and_the_rest_go_on(folder, monkeypatch):
    """Not a dead role but a bug in a step (here: a slice that raises once): the instance is
    restarted, its requests in flight end with the error, the waiting one completes, identical
    to a run without the fault, and later requests are served."""
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    with LLM(folder, kv_cache_tokens=64, max_num_seqs=1) as llm:
        want = llm.generate([[9, 8, 7]], params, use_tqdm=False)[0].outputs[0].token_ids
        d = llm.deployment
        running = d.add_request([5, 6, 7], params)
        waiting = d.add_request([9, 8, 7], params)  # max_num_seqs=1: waits for the first
        d.step()
        calls = _fail_once(monkeypatch, RuntimeError("a bug in a slice"))
        while d.has_work():
            d.step()
        assert calls and d.recoveries == 1
        assert running.finish_reason == "error" and "a bug in a slice" in str(running.error)
        assert waiting.error is None and waiting.output_ids == want
        assert llm.generate([[9, 8, 7]], params, use_tqdm=False)[0].outputs[0].token_ids == want


def test_seeded_sampling_continues_exactly_through_a_whole_instance_restart(folder, monkeypatch):
    """A role dies (a NodeFailure out of a slice, in process: the whole instance restarts and
    its requests recompute their KV in a fresh engine with a fresh sampler). Seeded sampled
    requests still end with the unfaulted run's tokens: each draw is keyed by the position of
    the token it samples, not taken from a stream that restarts with the engine."""
    from lamina.errors import NodeFailure
    prompts = [[5, 6, 7], [9, 8, 7, 6], [4, 4]]
    params = [SamplingParams(temperature=1.0, top_k=20, seed=s, max_tokens=12, ignore_eos=True)
              for s in (1, 2, 3)]
    with LLM(folder, kv_cache_tokens=64, prefix_caching=False) as llm:
        want = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        d = llm.deployment
        reqs = [d.add_request(p, sp) for p, sp in zip(prompts, params)]
        for _ in range(5):
            d.step()
        assert all(0 < len(r.output_ids) < 12 for r in reqs)
        calls = _fail_once(monkeypatch, NodeFailure("memory node 0 is gone"))
        while d.has_work():
            d.step()
        assert calls and d.instance_restarts == 1
        assert [r.output_ids for r in reqs] == want and all(r.error is None for r in reqs)


def _fail_once(monkeypatch, error: Exception) -> list[str]:
    """The replicas' next slice, or whole step in C++, raises ``error`` once; returns the list
    that names the call which raised (empty until then)."""
    from lamina.computenode.replica import ComputeReplica
    calls: list[str] = []

    def once(real):
        def run(self, *args):
            if not calls:
                calls.append(real.__name__)
                raise error
            return real(self, *args)
        return run
    for name in ("run_slice", "run_step"):  # a slice at a time, or the whole step in C++
        monkeypatch.setattr(ComputeReplica, name, once(getattr(ComputeReplica, name)))
    return calls


def test_generate_decodes_each_output_once_and_a_stream_as_it_goes(folder):
    """``generate`` decodes an output's text once, at the end (not the whole output at every
    step: a cost that grows with its length); ``generate_stream`` decodes as it goes, and its
    deltas add up to the same text."""
    calls = []

    class Tokenizer:
        def decode(self, ids, skip_special_tokens=True):
            calls.append(len(ids))
            return " ".join(map(str, ids))

    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    with LLM(folder) as llm:
        llm.tokenizer = Tokenizer()
        out = llm.generate([[5, 6, 7], [9, 4]], params, use_tqdm=False)
        assert len(calls) == 2
        want = [" ".join(map(str, o.outputs[0].token_ids)) for o in out]
        assert [o.outputs[0].text for o in out] == want
        calls.clear()
        text = ["", ""]
        for d in llm.generate_stream([[5, 6, 7], [9, 4]], params):
            text[d.index] += d.text
        assert text == want and len(calls) >= 2 * 8
