"""The OpenAI-compatible app over an in-process deployment (tiny llama, no tokenizer, no Ray)."""
import os
import sys

import pytest
from fastapi.testclient import TestClient

from lamina import LLM
from lamina.server.async_engine import AsyncEngine
from lamina.server.app import build_app

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "splitter"))
from tiny_models import tiny_folder  # noqa: E402


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    path = tiny_folder("llama", tmp_path_factory.mktemp("llama"))
    with LLM(path, memory=2, kv_cache_tokens=64) as llm:
        engine = AsyncEngine(llm.deployment)  # what ``lamina launch`` serves
        app = build_app(engine, None, "tiny", api_key="k", max_model_len=128)
        with TestClient(app, headers={"Authorization": "Bearer k"}) as c:
            yield c
        engine.shutdown()


def test_completion_with_token_ids(client):
    r = client.post("/v1/completions", json={"model": "tiny", "prompt": [5, 6, 7],
                                             "max_tokens": 5, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}
    assert body["choices"][0]["finish_reason"] == "length"


def test_streaming_sends_sse_chunks_then_done(client):
    with client.stream("POST", "/v1/completions",
                       json={"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 4,
                             "temperature": 0, "stream": True, "ignore_eos": True,
                             "stream_options": {"include_usage": True}}) as r:
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    assert '"usage"' in lines[-2] and '"completion_tokens": 4' in lines[-2]


@pytest.mark.parametrize("body,status,needle", [
    ({"model": "other", "prompt": [1]}, 404, "does not exist"),
    ({"model": "tiny", "prompt": [1], "temperature": -1}, 400, "temperature"),
    ({"model": "tiny", "prompt": [1], "max_tokens": 0}, 400, "max_tokens"),
    ({"model": "tiny", "prompt": [1], "n": 2}, 400, "n=1"),
    ({"model": "tiny", "prompt": []}, 400, "empty prompt"),
    ({"model": "tiny", "prompt": [1] * 200}, 400, "does not fit"),
    ({"model": "tiny", "prompt": "text"}, 400, "no tokenizer"),
    ({"model": "tiny"}, 400, "prompt"),
])
def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(client, body, status, needle):
    r = client.post("/v1/completions", json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert needle in err["message"] and {"type", "param", "code"} <= set(err)
    ok = client.post("/v1/completions", json={"model": "tiny", "prompt": [1, 2], "max_tokens": 2})
    assert ok.status_code == 200


def test_api_key_is_required(client):
    for headers in ({"Authorization": "Bearer wrong"}, {"Authorization": ""}):
        r = client.post("/v1/completions", json={"model": "tiny", "prompt": [1]}, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert client.get("/health").json() == {"status": "ok"}
    assert client.get("/v1/models").json()["data"][0]["id"] == "tiny"
    assert "lamina_kv_slots_capacity" in client.get("/metrics").text
