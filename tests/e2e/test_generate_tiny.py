"""End to end on tiny random llama, qwen2 and gpt2: greedy outputs of 8 mixed-length prompts,
run as one batch, are token-identical to HF generate (float32) in three memory setups (every
role in this process; every role a process of its own; requests spanning two nodes)."""
import pytest

from lamina import LLM, SamplingParams

from hf_oracle import hf_greedy
from tiny_models import tiny_folder, tiny_model

MAX_NEW = 10
PROMPTS = [[(11 * i + 7 * j + 5) % 90 + 3 for j in range(n)]
           for i, n in enumerate((3, 17, 1, 9, 22, 5, 12, 7))]
SETUPS = {
    "memory1-inproc": dict(memory=1, placement="inproc"),
    # the compute replica and 3 memory nodes as processes (shm channels)
    "memory3-procs": dict(memory=3, placement="procs", transport="shm"),
    # 24 slots per node: the longest request (22 + 10 tokens) must span two nodes, and the
    # batch does not fit at once (queueing and preemption happen too)
    "spans-two-nodes": dict(memory=2, placement="inproc", kv_cache_tokens=24),
}
SLOW = {"memory3-procs"}  # starts processes
ARCH: dict[str, str] = {}  # tiny model folder -> its architecture
HF_8BIT: dict = {}  # (folder, kv_dtype) -> HF's greedy outputs over that stored KV


@pytest.fixture(scope="module", params=["llama", "qwen2", "gpt2"])
def tiny(request, tmp_path_factory):
    folder = tiny_folder(request.param, tmp_path_factory.mktemp(request.param))
    ARCH[folder] = request.param
    model = tiny_model(request.param)  # the same seeded weights, as the oracle
    model.generation_config.eos_token_id = None
    return folder, hf_greedy(model, PROMPTS, MAX_NEW)


@pytest.mark.parametrize("setup", [pytest.param(s, marks=pytest.mark.slow) if s in SLOW else s
                                   for s in SETUPS])
def test_greedy_matches_hf(tiny, setup):
    folder, want = tiny
    with LLM(str(folder), **SETUPS[setup]) as llm:
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_NEW,
                                                    ignore_eos=True), use_tqdm=False)
        got = [o.outputs[0].token_ids for o in outs]
        assert got == want
        assert all(o.outputs[0].finish_reason == "length" and o.error is None for o in outs)
        if setup == "spans-two-nodes":
            assert max(req.max_shards for req, _, _ in llm._last) == 2
        inst = llm.deployment.instances[0]  # every request freed; the prefix cache holds the rest
        assert [c.stats().used_slots for c in inst.nodes] == inst.engine.scheduler.cache.held


def test_each_node_gets_one_run_of_rows(tiny):
    """The engine orders a micro-batch by node, so with single-node requests every node's
    rows are one run (ATTEND sends views, RESULTs are concatenated, no gather or merge)."""
    folder, want = tiny
    with LLM(str(folder), memory=3, placement="inproc") as llm:
        worker = llm.deployment.instances[0].engine.worker
        submitted = []
        submit = worker.submit

        def spy(slot, plan, routes, req_ids, params):
            submitted.append(routes)
            return submit(slot, plan, routes, req_ids, params)

        worker.submit = spy
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_NEW,
                                                    ignore_eos=True), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == want
    assert any(len(routes) == 3 for routes in submitted)
    assert all(r.span is not None for routes in submitted for r in routes)


@pytest.mark.gpu
@pytest.mark.parametrize("memory_device", ["cuda:0", "cpu"])
def test_cuda_graphs_keep_greedy_output_on_gpu(tiny, memory_device):
    """Compute on the GPU with and without CUDA graphs (memory nodes on the GPU, or on the CPU
    as in NEO): the same tokens as HF's float32 greedy run on CPU."""
    import torch
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    folder, want = tiny
    for graphs in (False, True):
        with LLM(str(folder), device="cuda:0", memory_device=memory_device, dtype="float32",
                 cuda_graphs=graphs, max_num_seqs=8) as llm:
            outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_NEW,
                                                        ignore_eos=True), use_tqdm=False)
            assert [o.outputs[0].token_ids for o in outs] == want, f"cuda_graphs={graphs}"
            replicas = llm.deployment.instances[0].engine.worker.replicas
            assert all((r.graphs is not None) == graphs for r in replicas)
            assert not graphs or all(r.graphs.replays > 0 for r in replicas)


def _hf_8bit(folder, kv_dtype: str) -> list[list[int]]:
    """HF's greedy outputs of PROMPTS over KV stored as ``kv_dtype`` (once per model)."""
    if (folder, kv_dtype) not in HF_8BIT:
        model = tiny_model(ARCH[folder])
        model.generation_config.eos_token_id = None
        HF_8BIT[folder, kv_dtype] = hf_greedy(model, PROMPTS, MAX_NEW, kv_dtype)
    return HF_8BIT[folder, kv_dtype]


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8_e4m3", "k16v8"])
@pytest.mark.parametrize("placement", ["inproc", pytest.param("procs", marks=pytest.mark.slow)])
def test_8bit_kv_greedy_matches_hf_over_the_same_stored_kv(tiny, kv_dtype, placement):
    """Memory nodes holding 8-bit KV (two nodes, requests spanning both): greedy output equals
    HF generate whose cache holds the same quantised values (hf_oracle.fake_quant_cache)."""
    folder, _ = tiny
    want = _hf_8bit(folder, kv_dtype)
    with LLM(str(folder), memory=2, placement=placement, kv_cache_tokens=24,
             kv_dtype=kv_dtype) as llm:
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_NEW,
                                                    ignore_eos=True), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == want
        if placement == "inproc":
            assert llm.deployment.instances[0].nodes[0].node.pool.fmt.name == kv_dtype


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype", ["int8", "fp8_e4m3", "k16v8"])
def test_8bit_kv_on_a_gpu_memory_node_matches_hf(tiny, kv_dtype):
    """The same, compute and two memory nodes on the GPU (the Triton kernel reading the
    8-bit pools): greedy output equals HF's over the same stored KV (on the CPU)."""
    import torch
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    folder, _ = tiny
    with LLM(str(folder), device="cuda:0", memory_device="cuda:0", dtype="float32", memory=2,
             kv_cache_tokens=24, kv_dtype=kv_dtype) as llm:
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_NEW,
                                                    ignore_eos=True), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == _hf_8bit(folder, kv_dtype)
        assert llm.deployment.instances[0].nodes[0].node.pool.fmt.name == kv_dtype


def test_a_precomputed_context_decodes_beside_real_requests(tiny):
    """Engine.add_precomputed (synthetic contexts, for benchmarks): zeros imported as the
    prompt's KV across two nodes, the request decodes to max_tokens and frees its KV, and a
    real request in the same steps still matches HF."""
    folder, want = tiny
    with LLM(str(folder), memory=2, kv_cache_tokens=40, kv_dtype="int8") as llm:
        d = llm.deployment
        eng = d.instances[0].engine
        pool = d.instances[0].nodes[0].node.pool
        syn = eng.add_precomputed(list(range(3, 63)), SamplingParams(temperature=0, max_tokens=5,
                                                                     ignore_eos=True),
                                  (pool.num_layers, pool.num_kv_heads, pool.head_dim), chunk=16)
        assert syn.num_computed == 59 and len(syn.shards) == 2  # spans both nodes
        assert sum(c.stats().used_slots for c in d.instances[0].nodes) == 59
        real = eng.add_request(PROMPTS[4], SamplingParams(temperature=0, max_tokens=MAX_NEW,
                                                          ignore_eos=True))
        while d.has_work():
            d.step()
        assert len(syn.output_ids) == 5 and syn.error is None
        assert real.output_ids == hf_greedy(tiny_model(ARCH[folder]), [PROMPTS[4]], MAX_NEW,
                                            "int8")[0]
        # the synthetic context (zeros) is never cached; the real request's KV is
        assert [c.stats().used_slots for c in d.instances[0].nodes] == eng.scheduler.cache.held
        assert sum(eng.scheduler.cache.held) == len(real.all_ids) - 1
