"""One instance type under three placements: the matrix placement x compute
replicas x pipeline gives greedy output token-identical to transformers in float32, and
borrowing (a request longer than one pool) works under every placement. In-process cases are
fast; processes and Ray start real roles (slow)."""
from __future__ import annotations

import psutil
import pytest

from lamina import LLM, SamplingParams
from lamina.config import deployment_config

from hf_oracle import hf_greedy
from tiny_models import tiny_folder, tiny_model
from live_children import live_children  # noqa: E402

MAX_NEW = 8
PROMPTS = [[(11 * i + 7 * j + 5) % 90 + 3 for j in range(n)]
           for i, n in enumerate((3, 17, 1, 9, 22, 5, 12))]
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
PIPELINES = [(1, "none"), (1, "fixed"), (1, "rotational"), (2, "fixed"), (2, "rotational")]
PLACEMENTS = [pytest.param("inproc"), pytest.param("procs", marks=pytest.mark.slow),
              pytest.param("ray", marks=pytest.mark.slow)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tiny_folder("llama", tmp_path_factory.mktemp("llama"))
    model = tiny_model("llama")
    model.generation_config.eos_token_id = None
    return folder, model, hf_greedy(model, PROMPTS, MAX_NEW)


@pytest.fixture(scope="module")
def ray_up():
    """One local Ray for the module (every ray-placed LLM joins it instead of starting its own);
    shut down at the end."""
    import ray

    from lamina.instance.ray_actors import ensure_ray
    started = ensure_ray(None, {"lamina_compute": 8, "lamina_memory": 8})
    yield
    if started:
        ray.shutdown()


def _children() -> set[int]:
    return live_children()


@pytest.mark.parametrize("compute,pipeline", PIPELINES,
                         ids=[f"C{c}-{p}" for c, p in PIPELINES])
@pytest.mark.parametrize("placement", PLACEMENTS)
def test_greedy_matches_hf(tiny, request, placement, compute, pipeline):
    folder, _, want = tiny
    if placement == "ray":
        request.getfixturevalue("ray_up")
    before = _children()
    with LLM(str(folder), compute=compute, memory=2, pipeline=pipeline,
             placement=placement) as llm:
        icfg = llm.config.instance
        assert (icfg.compute, icfg.pipeline.schedule) == (compute, pipeline)
        outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert [o.error for o in outs] == [None] * len(PROMPTS)
        assert [o.outputs[0].token_ids for o in outs] == want
        inst = llm.deployment.instances[0]
        # every request freed: the prefix cache holds what is left
        assert [c.stats().used_slots for c in inst.nodes] == inst.engine.scheduler.cache.held
        if placement != "inproc":
            assert inst.engine.worker.max_in_flight == icfg.pipeline.micro_batches
    if placement == "procs":
        assert _children() - before == set()  # close() leaves no process behind


def test_compute_2_without_a_pipeline_is_a_clear_error():
    with pytest.raises(ValueError, match="pipeline 'none' runs one micro-batch"):
        deployment_config("x", compute=2, pipeline="none")
    with pytest.raises(ValueError, match="placement must be one of"):
        deployment_config("x", placement="cluster")


POOL = 40  # KV slots of each instance's one memory node


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_borrowing_request_longer_than_one_pool(tiny, request, placement):
    """Two instances with one 40-slot node each: a 50-token prompt only fits by borrowing the
    other pool's slots; its output equals HF's, and it spans both pools."""
    folder, model, _ = tiny
    if placement == "ray":
        request.getfixturevalue("ray_up")
    long = [(13 * j + 3) % 90 + 3 for j in range(50)]
    short = PROMPTS[:3]
    want = hf_greedy(model, [long, *short], MAX_NEW)
    with LLM(str(folder), compute=2, memory=1, instances=2, kv_cache_tokens=POOL, slab_size=8,
             placement=placement, max_num_seqs=4) as llm:
        d = llm.deployment
        reqs = [d.add_request(p, GREEDY) for p in [long, *short]]
        while d.has_work():
            d.step()
        assert [r.error for r in reqs] == [None] * len(reqs)
        assert [r.output_ids for r in reqs] == want
        assert reqs[0].max_shards > 1  # stored on (and attended over) two pools
        assert {r.req_id // (1 << 40) for r in reqs} == {0, 1}  # both instances served


@pytest.mark.slow
def test_procs_roles_pin_themselves_to_their_cores_and_name_themselves(tiny):
    """device / memory_device name the cores each side owns; every role process runs there
    and names its role in ``ps``."""
    folder, _, want = tiny
    cores = sorted(__import__("os").sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("needs two cores")
    a, b = cores[0], cores[1]
    with LLM(str(folder), compute=2, memory=2, placement="procs", device=f"cpu:{a}",
             memory_device=f"cpu:{b}") as llm:
        inst = llm.deployment.instances[0]
        for i, proc in enumerate(inst.engine.worker.procs):
            assert psutil.Process(proc.pid).cpu_affinity() == [a]
            assert " ".join(psutil.Process(proc.pid).cmdline()).strip() == f"lamina: replica {i}"
        for i, node in enumerate(inst.nodes):
            assert psutil.Process(node.process.pid).cpu_affinity() == [b]
            assert " ".join(psutil.Process(node.process.pid).cmdline()).strip() == f"lamina: memory node {i}"
        outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == want
