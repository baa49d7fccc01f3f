"""The OpenAI-compatible app over an in-process deployment (tiny llama, no tokenizer, no Ray)."""
import json
import os
import socket
import sys
import threading
import time

import pytest

uvicorn = pytest.importorskip("uvicorn")
pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402

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
        app = build_app(engine, None, "tiny", api_key="k", max_model_len=256)
        with TestClient(app, headers={"Authorization": "Bearer k"}) as c:
            c.engine = engine
            yield c
        engine.shutdown()


def test_completion_with_token_ids(client):
    r = client.post("/v1/completions", json={"model": "tiny", "prompt": [5, 6, 7],
                                             "max_tokens": 5, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8,
                             "prompt_tokens_details": {"cached_tokens": 0}}
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


def _ok(client) -> None:
    r = client.post("/v1/completions", json={"model": "tiny", "prompt": [1, 2], "max_tokens": 2})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("method,path,kwargs,status,needle", [
    ("post", "/v1/completions", dict(content=b'{"model": "tiny", "prompt": [1,',
                                     headers={"content-type": "application/json"}), 400, "not valid JSON"),
    ("post", "/v1/completions", dict(content=b'plain words'), 400, "a JSON object"),
    ("post", "/v1/completions", dict(content=b'{"model": "\xff\xfe"}',
                                     headers={"content-type": "application/json"}), 400, "parsing the body"),
    ("get", "/v1/nothing-here", {}, 404, "Not Found"),
    ("get", "/v1/completions", {}, 405, "Method Not Allowed"),
])
def test_every_error_is_openai_json(client, method, path, kwargs, status, needle):
    r = getattr(client, method)(path, **kwargs)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert needle in err["message"] and err["param"] is None and {"type", "code"} <= set(err)
    _ok(client)


@pytest.mark.parametrize("max_tokens", [10**12, 10**30, 254])
def test_max_tokens_past_the_context_is_a_400(client, max_tokens):
    """As vLLM answers: naming the context length, the prompt's tokens and the request."""
    r = client.post("/v1/completions", json={"model": "tiny", "prompt": [5, 6, 7],
                                             "max_tokens": max_tokens, "temperature": 0})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "context_length_exceeded" and err["param"] == "max_tokens"
    assert "maximum context length is 256 tokens" in err["message"]
    assert f"(3 in the prompt, {max_tokens} in max_tokens)" in err["message"]
    _ok(client)


def test_max_tokens_as_a_huge_float_is_a_400(client):
    r = client.post("/v1/completions", json={"model": "tiny", "prompt": [5, 6, 7],
                                             "max_tokens": 1e30})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "max_tokens"
    _ok(client)


def test_max_tokens_that_fits_the_context_is_served(client):
    r = client.post("/v1/completions", json={"model": "tiny", "prompt": [5, 6, 7],
                                             "max_tokens": 100, "temperature": 0,
                                             "ignore_eos": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["total_tokens"] == 103


def test_a_prompt_longer_than_the_context_is_a_400(client):
    r = client.post("/v1/completions", json={"model": "tiny", "prompt": [1] * 256})
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "context_length_exceeded"


def test_a_full_queue_answers_429_with_retry_after(client):
    client.engine.max_open = 0
    try:
        r = client.post("/v1/completions", json={"model": "tiny", "prompt": [1, 2]})
    finally:
        client.engine.max_open = None
    assert r.status_code == 429 and r.headers["retry-after"] == "1"
    assert r.json()["error"]["type"] == "rate_limit_error"
    _ok(client)


def _wait(cond, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def test_a_client_that_disconnects_aborts_its_non_streaming_request(client, monkeypatch):
    engine = client.engine
    step = engine.engine.step
    monkeypatch.setattr(engine.engine, "step", lambda: (time.sleep(0.05), step())[1])  # slow
    server = uvicorn.Server(uvicorn.Config(client.app, host="127.0.0.1", port=0,
                                           log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        _wait(lambda: server.started, "the server")
        port = server.servers[0].sockets[0].getsockname()[1]
        finished = dict(engine.metrics.finished)
        body = json.dumps({"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 100,
                           "temperature": 0, "ignore_eos": True})
        with socket.create_connection(("127.0.0.1", port)) as sock:
            sock.sendall((f"POST /v1/completions HTTP/1.1\r\nHost: t\r\n"
                          f"Authorization: Bearer k\r\nContent-Type: application/json\r\n"
                          f"Content-Length: {len(body)}\r\n\r\n{body}").encode())
            _wait(lambda: engine.open_requests == 1, "the request to start")
        _wait(lambda: engine.open_requests == 0, "the request to be aborted")
        _wait(lambda: engine.engine.counts() == (0, 0), "the engine to drop it")
        assert engine.metrics.finished == finished  # aborted, not run to its end
    finally:
        server.should_exit = True
        thread.join(timeout=30)
    _ok(client)


def test_health_says_recovering_during_a_restart_and_metrics_count_restarts(client):
    """While the deployment restarts an instance (its engine thread busy in ``restart``),
    /health is a 503 ``recovering``; /metrics counts restarts by kind (a whole instance, a
    memory node or a replica restarted alone)."""
    dep = client.engine.engine
    seen, real = [], dep.restart

    def refused(i):
        seen.append((dep.recovering, client.get("/health")))
        raise RuntimeError("no memory host left")
    dep.restart = refused
    try:
        with pytest.raises(RuntimeError):
            dep._restart(0)
    finally:
        dep.restart = real
    ((count, health),) = seen
    assert count == 1 and health.status_code == 503 and health.json() == {"status": "recovering"}
    assert dep.recovering == 0 and client.get("/health").json() == {"status": "ok"}
    before = (dep.instance_restarts, dep.node_restarts, dep.replica_restarts)
    dep.instance_restarts, dep.node_restarts, dep.replica_restarts = \
        before[0] + 2, before[1] + 3, before[2] + 1
    try:
        client.engine._update_stats()
        text = client.get("/metrics").text
        for kind, n in (("instance", before[0] + 2), ("memory_node", before[1] + 3),
                        ("replica", before[2] + 1)):
            assert f'lamina_restarts_total{{kind="{kind}"}} {float(n)}' in text
    finally:
        dep.instance_restarts, dep.node_restarts, dep.replica_restarts = before


def test_no_capacity_is_a_503_with_retry_after_until_an_instance_serves_again(client):
    """While every instance has lost a role and cannot be restarted, new requests get a 503
    with Retry-After and /health says no_capacity; once one serves again, so does the server.
    (Capacity loss is injected: the instance is marked failed and its restart refused.)"""
    dep = client.engine.engine
    inst, real = dep.instances[0], dep.restart
    dep.restart = lambda i: (_ for _ in ()).throw(RuntimeError("no memory host left"))
    inst.failed, inst.retry_at = RuntimeError("memory node 1 died"), 0.0
    try:
        r = client.post("/v1/completions", json={"model": "tiny", "prompt": [1, 2]})
        assert r.status_code == 503 and int(r.headers["retry-after"]) >= 1
        assert r.json()["error"]["code"] == "service_unavailable"
        assert "no instance can serve now" in r.json()["error"]["message"]
        h = client.get("/health")
        assert h.status_code == 503 and h.json() == {"status": "no_capacity"}
    finally:
        inst.failed, dep.restart = None, real
    assert client.get("/health").json() == {"status": "ok"}
    _ok(client)


def test_a_second_turn_reports_its_cached_prompt_tokens_and_metrics_count_them(client):
    """The prefix cache through the server: a prompt that continues an earlier one has that
    part cached; usage and (once the engine's stats are refreshed) /metrics say so."""
    first = [40 + i for i in range(20)]
    r = client.post("/v1/completions", json={"model": "tiny", "prompt": first, "max_tokens": 3,
                                              "temperature": 0})
    assert r.json()["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    r = client.post("/v1/completions", json={"model": "tiny", "prompt": first + [7, 8],
                                              "max_tokens": 2, "temperature": 0})
    assert r.json()["usage"]["prompt_tokens_details"] == {"cached_tokens": len(first)}
    for _ in range(100):  # the engine refreshes its stats about once a second
        text = client.get("/metrics").text
        hits = [float(line.split()[-1]) for line in text.splitlines()
                if line.startswith("lamina_prefix_cache_hit_tokens_total")]
        if hits and hits[0] >= len(first):
            break
        time.sleep(0.1)
    assert hits and hits[0] >= len(first) and "lamina_prefix_cache_slots" in text


def test_a_count_that_goes_down_is_counted_on_from_there():
    """An engine count that falls (a test puts a counter back; a rebuilt engine starts again)
    never makes /metrics fail: the Prometheus counter holds, then advances from the new value
    (the race that failed the next test's /metrics when a render came before the refresh)."""
    from lamina.server.async_engine import EngineMetrics
    from lamina.server.metrics import MetricsExporter

    e = MetricsExporter()
    e.render(EngineMetrics(restarts={"replica": 3}, generated_tokens=9, finished={"stop": 2}))
    e.render(EngineMetrics(restarts={"replica": 1}, generated_tokens=4, finished={"stop": 1}))
    text = e.render(EngineMetrics(restarts={"replica": 2}, generated_tokens=6,
                                  finished={"stop": 2}))
    assert b'lamina_restarts_total{kind="replica"} 4.0' in text
    assert b"lamina_generated_tokens_total 11.0" in text
    assert b'lamina_requests_finished_total{reason="stop"} 3.0' in text


def test_each_metrics_exporter_counts_its_own_engine():
    """Exporters are per app: one that saw restarts never offsets another engine's counts (a
    process-wide table keyed by id() did, once a collected engine's id was reused)."""
    from lamina.server.async_engine import EngineMetrics
    from lamina.server.metrics import MetricsExporter

    first = MetricsExporter()
    first.render(EngineMetrics(restarts={"instance": 2}, generated_tokens=5))
    text = MetricsExporter().render(EngineMetrics(restarts={"instance": 0}, generated_tokens=1))
    assert b'lamina_restarts_total{kind="instance"} 0.0' in text
    assert b"lamina_generated_tokens_total 1.0" in text
