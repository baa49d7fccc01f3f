"""Compute replicas as separate processes (``LLM(placement="procs")``: every replica and every
memory node a process of its own): memory nodes reply to the replica that runs the next slice
and contexts move replica to replica. Greedy outputs stay token-identical to HF, seeded sampling
equals the in-process run, and a killed memory node or replica is replaced without changing any
output and leaves no process behind. (tests/instance/test_placements.py covers the other pipelines under procs.)"""
import os
import signal
from pathlib import Path

import psutil
import pytest

from lamina import LLM, SamplingParams
from lamina.models import load_model

from hf_oracle import hf_greedy, tiny_case
from live_children import live_children  # noqa: E402

pytestmark = pytest.mark.slow  # every LLM here starts processes
MAX_NEW = 10
PROMPTS = [[(11 * i + 7 * j + 5) % 90 + 3 for j in range(n)]
           for i, n in enumerate((3, 17, 1, 9, 22, 5, 12, 7))]
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)


def _children() -> set[int]:
    return live_children()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_case("llama", tmp_path_factory, PROMPTS, MAX_NEW)


def test_process_replicas_tight_pool_and_mini_batches_match_hf(tiny):
    """3 replica processes, 4 micro-batches, 24 slots per node: requests span two nodes, queue
    and get preempted while others are in flight; each node's share of a layer in 2 parts."""
    folder, want = tiny
    with LLM(str(folder), compute=3, memory=2, micro_batches=4, pipeline="rotational",
             kv_cache_tokens=24, attn_parts=2, placement="procs") as llm:
        inst = llm.deployment.instances[0]
        worker = inst.engine.worker
        assert len(worker.procs) == 3 and all(p.is_alive() for p in worker.procs)
        assert all(c.process.is_alive() for c in inst.nodes)
        outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == want
        assert all(o.error is None for o in outs)
        assert max(r.max_shards for r, _, _ in llm._last) == 2
        # more than one micro-batch in flight (with a tight pool, not always all 4)
        assert worker.max_in_flight > 1
        assert worker.times().steps > 0
        assert [c.stats().used_slots for c in inst.nodes] == inst.engine.scheduler.cache.held


def test_one_replica_process_interleaves_two_micro_batches(tiny, tmp_path):
    """One replica process, one memory node, two micro-batches (rotational): while one
    micro-batch's attention runs on the node, the replica runs the other's slices, so their
    steps overlap in time (neither waits in place for its RESULTs, as a lone one does);
    greedy outputs equal HF."""
    folder, want = tiny
    with LLM(str(folder), memory=1, micro_batches=2, pipeline="rotational", placement="procs",
             trace=str(tmp_path / "run.json")) as llm:
        outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        spans = [s for s in llm.timeline.spans if s.role == "compute"]
    assert [o.outputs[0].token_ids for o in outs] == want
    steps: dict[int, list] = {}
    for s in spans:
        steps.setdefault(s.args["step"], []).append(s)
    ranges = sorted((min(s.start_ns for s in v), max(s.end_ns for s in v),
                     v[0].args["micro_batch"]) for v in steps.values())
    overlaps = sum(1 for a, b in zip(ranges, ranges[1:]) if b[0] < a[1] and b[2] != a[2])
    # two micro-batches in flight overlap; a run of whole steps would overlap none (only a
    # STEP that lands while the other's step runs)
    assert overlaps >= len(ranges) // 4, ranges


def test_process_replicas_sample_like_in_process_and_trace(tiny, tmp_path):
    """The engine draws the uniforms, so seeded sampling does not depend on which replica
    process samples; the timeline has spans of both replicas and both nodes."""
    folder, _ = tiny
    params = [SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=i, max_tokens=MAX_NEW,
                             ignore_eos=True) for i in range(len(PROMPTS))]
    with LLM(str(folder), memory=2, placement="inproc") as llm:
        want = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    trace = tmp_path / "run.json"
    with LLM(str(folder), compute=2, memory=2, placement="procs", transport="shm",
             trace=str(trace)) as llm:
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
        tracks = {(s.role, s.track) for s in llm.timeline.spans}
    assert got == want
    assert {("compute", 0), ("compute", 1), ("memory", 0), ("memory", 1)} <= tracks
    assert trace.is_file()


def test_a_transport_that_no_longer_exists_is_a_clear_error(tiny):
    """``transport`` only names the links between roles out of process: the former in-process
    ``local`` is refused before anything starts."""
    folder, _ = tiny
    before = _children()
    with pytest.raises(ValueError, match="transport must be one of auto, shm, tcp"):
        LLM(str(folder), compute=2, placement="procs", transport="local")
    assert _children() - before == set()


@pytest.mark.parametrize("victim", ["memory node", "compute replica"])
def test_killed_process_is_replaced_and_outputs_are_unchanged(tiny, victim):
    """Rotational pipelining over 2 replicas: kill -9 of a memory node or of replica 1 mid-
    generation restarts that role alone, with its index (same instance, the other roles' same
    processes: the micro-batches in flight are rolled back on the nodes and re-run; a new node
    is empty, a new replica joins the ring of contexts). Every request completes with the
    unfaulted output, greedy or sampled with a seed (draws are keyed by position: the steps
    dropped in flight leave no trace)."""
    folder, _ = tiny
    before = _children()
    prompts = PROMPTS[:4]
    params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
              SamplingParams(temperature=1.0, top_k=20, seed=7, max_tokens=40, ignore_eos=True)] * 2
    with LLM(str(folder), compute=2, memory=2, placement="procs") as llm:
        want = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        inst = llm.deployment.instances[0]
        pid = (inst.nodes[1].process.pid if victim == "memory node"
               else inst.engine.worker.procs[1].pid)
        assert pid in _children() - before
        replicas = [p.pid for p in inst.engine.worker.procs]
        got = _kill_mid_stream(llm, prompts, params, pid)
        d = llm.deployment
        assert got == want and d.recoveries == 1 and d.instances[0] is inst
        node = victim == "memory node"
        assert (d.node_restarts, d.replica_restarts) == ((1, 0) if node else (0, 1))
        now = [p.pid for p in inst.engine.worker.procs]
        assert now == replicas if node else (now[0] == replicas[0] and now[1] != pid)
        assert inst.nodes[1].process.is_alive() and all(p.is_alive() for p in
                                                        inst.engine.worker.procs)
    psutil.wait_procs([psutil.Process(p) for p in _children() - before], timeout=10)
    assert _children() - before == set()


def test_smollm2_process_replicas_rotational_matches_hf():
    texts = ["The capital of France is", "def fibonacci(n):", "1, 2, 3, 4,", "Hello",
             "Write a haiku about the sea.", "In 1492, Columbus"]
    loaded = load_model("smollm2")
    ids = [loaded.tokenizer(t, add_special_tokens=False).input_ids for t in texts]
    want = hf_greedy(loaded.model, ids, 12)
    with LLM("smollm2", memory=2, compute=2, micro_batches=3, pipeline="rotational",
             placement="procs", transport="shm") as llm:
        outs = llm.generate(texts, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == want



KILL_AND_EXIT = '''
import os, signal, sys, time
from lamina import LLM, SamplingParams

if __name__ == "__main__":
    p = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    with LLM(sys.argv[1], memory=1, placement="procs") as llm:
        llm.generate([[5, 6, 7]], p, use_tqdm=False)
        os.kill(llm.deployment.instances[0].nodes[0].process.pid, signal.SIGKILL)
        time.sleep(0.5)
        assert llm.generate([[5, 6, 7]], p, use_tqdm=False)[0].error is None
'''


def test_a_killed_node_leaves_no_resource_tracker_warning_at_exit(tiny, tmp_path):
    """A dead node's shared-memory names are dropped by the replica that attached; the node
    (the creator) must have dropped its resource-tracker registration once attached, or the
    tracker warns about each at the engine's exit, on the user's terminal."""
    import subprocess
    import sys
    folder, _ = tiny
    script = tmp_path / "kill_and_exit.py"
    script.write_text(KILL_AND_EXIT)
    r = subprocess.run([sys.executable, str(script), str(folder)], capture_output=True, text=True,
                       timeout=300, env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])})
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resource_tracker" not in r.stderr, r.stderr[-3000:]


def test_a_spare_takes_the_dead_replica_s_place(tiny):
    """spare=True: the launcher keeps a role process ready; a killed replica's place goes to
    it (its pid), the output is the unfaulted one, and a new spare waits for the next death."""
    import time
    folder, _ = tiny
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    with LLM(str(folder), memory=1, placement="procs", spare=True) as llm:
        want = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:3], params, use_tqdm=False)]
        launcher = llm.deployment.launcher
        spare, pipe = launcher._spare
        deadline = time.monotonic() + 120
        while not pipe.poll() and time.monotonic() < deadline:  # its imports done
            time.sleep(0.05)
        inst = llm.deployment.instances[0]
        got = _kill_mid_stream(llm, PROMPTS[:3], params, inst.engine.worker.procs[0].pid)
        assert got == want and llm.deployment.replica_restarts == 1
        assert inst.engine.worker.procs[0].pid == spare.pid
        assert launcher._spare is not None and launcher._spare[0] is not spare


def _kill_mid_stream(llm, prompts, params, pid):
    got: list[list[int]] = [[] for _ in prompts]
    stream = llm.generate_stream(prompts, params)
    d = next(stream)
    got[d.index] += d.token_ids
    os.kill(pid, signal.SIGKILL)
    for d in stream:
        assert d.finish_reason != "error", d
        got[d.index] += d.token_ids
    return got
