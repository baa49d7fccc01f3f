"""Pre-launched slices and whole-step graphs (``device_polling="emulated"``, the CPU stand-in
of device-side polling) under processes and in process: the replica core's bookkeeping keeps
greedy output equal to HF. Not marked slow: this is the only CI run of those paths."""
import pytest

from lamina import LLM, SamplingParams

from hf_oracle import tiny_case

MAX_NEW = 10
PROMPTS = [[(11 * i + 7 * j + 5) % 90 + 3 for j in range(n)]
           for i, n in enumerate((3, 17, 1, 9, 22, 5, 12, 7))]
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_case("llama", tmp_path_factory, PROMPTS, MAX_NEW)


@pytest.mark.parametrize("placement", ["procs", "inproc"])
def test_prelaunched_slices_keep_greedy_output(tiny, tmp_path, placement):
    """``device_polling="emulated"`` (the CPU stand-in of pre-launching each next slice behind a
    device flag): two micro-batches on one replica, outputs equal to HF, and the timeline
    shows slices released by landed results."""
    folder, want = tiny
    with LLM(str(folder), memory=2, placement=placement, micro_batches=2, pipeline="rotational",
             device_polling="emulated", trace=str(tmp_path / "run.json")) as llm:
        outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        names = {s.name for s in llm.timeline.spans if s.role == "compute"}
    assert [o.outputs[0].token_ids for o in outs] == want
    assert any(n.endswith("(landed)") for n in names), sorted(names)[:10]


@pytest.mark.parametrize("placement", ["procs", "inproc"])
def test_whole_step_graphs_keep_greedy_output(tiny, tmp_path, placement):
    """``cuda_graphs`` with ``device_polling="emulated"``: each decode step is one (CPU
    stand-in) graph of every slice with its sends and waits over the step mailbox, two nodes
    answering through it (under ``procs`` from their own processes, over the replica
    process's shared mailbox); outputs equal to HF, and the timeline shows whole-step
    launches."""
    folder, want = tiny
    with LLM(str(folder), memory=2, placement=placement, micro_batches=2, pipeline="rotational",
             cuda_graphs=True, device_polling="emulated",
             trace=str(tmp_path / "run.json")) as llm:
        outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        names = {s.name for s in llm.timeline.spans if s.role == "compute"}
    assert [o.outputs[0].token_ids for o in outs] == want
    assert "step (graph) + sample" in names, sorted(names)


@pytest.mark.gpu
@pytest.mark.parametrize("placement", ["inproc", "procs"])
def test_whole_step_cuda_graphs_with_host_memory_nodes(tiny, placement):
    """The same on a GPU: each decode step one CUDA graph waiting on the mailbox's flags,
    memory nodes on the host's cores (NEO's layout) answering from this process or from
    processes of their own."""
    import torch

    from lamina.computenode.device_wait import unavailable
    if not torch.cuda.is_available() or unavailable() is not None:
        pytest.skip(unavailable() if torch.cuda.is_available() else "needs a CUDA GPU")
    folder, want = tiny
    with LLM(str(folder), memory=2, device="cuda:0", memory_device="cpu", cuda_graphs=True,
             device_polling="cuda", placement=placement) as llm:
        outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want


@pytest.mark.parametrize("victim", ["memory node", "compute replica"])
def test_whole_step_graphs_survive_a_killed_role(tiny, tmp_path, victim):
    """Whole-step graphs (emulated) under ``procs``: kill -9 of a memory node mid-generation
    fails the step in flight (a stand-in answers the dead node's SENDs FAILED), the node is
    restarted alone and joins the replica's mailbox; a killed replica is restarted with a
    mailbox of its own, which every node then serves. Every request ends with its unfaulted
    greedy output."""
    import os
    import signal

    folder, _ = tiny
    prompts, params = PROMPTS[:4], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    with LLM(str(folder), memory=2, placement="procs", cuda_graphs=True,
             device_polling="emulated", trace=str(tmp_path / "run.json")) as llm:
        want = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        got: list[list[int]] = [[] for _ in prompts]
        stream = llm.generate_stream(prompts, params)
        d = next(stream)
        got[d.index] += d.token_ids
        inst = llm.deployment.instances[0]
        node = victim == "memory node"
        os.kill(inst.nodes[1].process.pid if node else inst.engine.worker.procs[0].pid,
                signal.SIGKILL)
        for d in stream:
            assert d.finish_reason != "error", d
            got[d.index] += d.token_ids
        assert got == want
        d = llm.deployment
        assert (d.recoveries, d.node_restarts, d.replica_restarts) == ((1, 1, 0) if node
                                                                       else (1, 0, 1))
        graphs = _graph_steps(llm)
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params,
                                                             use_tqdm=False)] == want
        assert _graph_steps(llm) > graphs  # the restarted role is back on whole-step graphs


def _graph_steps(llm) -> int:
    return sum(s.name == "step (graph) + sample" for s in llm.timeline.spans)
