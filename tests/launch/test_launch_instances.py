"""``lamina launch --instances 2 --compute 2 --memory 2``: two Ray-placed instances (each two
compute replicas, rotational pipelining, and two memory nodes) behind one router. A prompt
longer than one instance's pool is served by borrowing the other's KV space and matches HF
greedy output; concurrent requests spread over both instances equal single requests; the
metrics cover both pools; shutdown leaves nothing behind."""
from __future__ import annotations

import concurrent.futures as cf
import sys
import urllib.request
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")
from launch_harness import launched  # tests/launch is on sys.path (pytest rootdir mode)

from lamina.models import load_model

sys.path.insert(0, str(Path(__file__).parents[1] / "e2e"))
from hf_oracle import hf_greedy  # noqa: E402

pytestmark = pytest.mark.slow
POOL = 160  # KV slots of each instance's pool (two memory nodes of 80)
NEW = 8


@pytest.fixture(scope="module")
def server():
    with launched("--model", "smollm2", "--instances", "2", "--compute", "2", "--memory", "2",
                  "--kv-cache-tokens", str(POOL // 2), "--slab-size", "16") as (port, ready):
        assert "instances 2, compute 2, memory 2" in ready and "borrowing on" in ready, ready
        yield openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x",
                            max_retries=0), port


def test_a_prompt_longer_than_one_pool_borrows_and_matches_hf(server):
    client, _ = server
    loaded = load_model("smollm2")
    text = ("The history of the printing press begins in the fifteenth century, when movable "
            "type changed how books were made and shared across Europe. ") * 8
    ids = loaded.tokenizer(text, add_special_tokens=False).input_ids
    assert POOL < len(ids) + NEW < 2 * POOL  # fits the cluster, not one pool
    want = hf_greedy(loaded.model, [ids], NEW)[0]
    r = client.completions.create(model="smollm2", prompt=ids, max_tokens=NEW, temperature=0)
    assert r.usage.completion_tokens == NEW
    assert r.choices[0].text == loaded.tokenizer.decode(want, skip_special_tokens=True)


def test_concurrent_requests_over_two_instances_match_single_requests(server):
    client, port = server
    prompts = [f"Question {i}: name a colour. Answer:" for i in range(12)]

    def one(p):
        return client.completions.create(model="smollm2", prompt=p, max_tokens=6,
                                         temperature=0).choices[0].text

    single = [one(p) for p in prompts]
    with cf.ThreadPoolExecutor(12) as ex:
        assert list(ex.map(one, prompts)) == single
    metrics = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read().decode()
    capacity = [ln for ln in metrics.splitlines() if ln.startswith("lamina_kv_slots_capacity")]
    assert len(capacity) == 4, metrics  # two memory nodes per instance
