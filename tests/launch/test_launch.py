"""``lamina launch`` end to end with the official ``openai`` client: two compute replicas
(rotational pipelining, 3 micro-batches) and two memory nodes placed by a local Ray instance;
once with the default transport (shm on one host) stopped by Ctrl-C (SIGINT), and once forced
to tcp stopped by SIGTERM, whose outputs must be identical. Shutdown leaves no process
behind."""
from __future__ import annotations

import os
import signal
import threading
import urllib.request

import concurrent.futures as cf

import psutil
import pytest

openai = pytest.importorskip("openai")
from launch_harness import launched  # tests/launch is on sys.path (pytest rootdir mode)

pytestmark = pytest.mark.slow
KEY = "test-key"
PROMPTS = [f"Question {i}: what is {i} plus {i}? Answer:" for i in range(32)]
RESULTS: dict[str, dict] = {}


@pytest.fixture(scope="module", params=["auto", "tcp"])
def server(request):
    stop = signal.SIGINT if request.param == "auto" else signal.SIGTERM
    with launched("--model", "smollm2", "--compute", "2", "--memory", "2", "--api-key", KEY,
                  "--transport", request.param, "--kv-cache-tokens", "512",
                  stop=stop) as (port, ready):
        for part in ("placement ray", "compute 2", "memory 2", "pipeline rotational x3",
                     f"transport {request.param}"):
            assert part in ready, ready
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY,
                               max_retries=0)
        yield request.param, client, port


def _greedy(client, prompt, **kw):
    return client.completions.create(model="smollm2", prompt=prompt, max_tokens=8,
                                     temperature=0, **kw)


def test_completions_and_chat_stream_and_not(server):
    name, client, _ = server
    assert [m.id for m in client.models.list().data] == ["smollm2"]
    r = _greedy(client, "The capital of France is")
    assert r.choices[0].text and r.choices[0].finish_reason in ("length", "stop")
    assert r.usage.prompt_tokens == 5 and r.usage.completion_tokens == 8
    streamed = "".join(c.choices[0].text for c in _greedy(client, "The capital of France is",
                                                          stream=True))
    assert streamed == r.choices[0].text
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    chat = client.chat.completions.create(model="smollm2", messages=msgs, max_tokens=12,
                                          temperature=0)
    assert chat.choices[0].message.role == "assistant" and chat.choices[0].message.content
    parts, usage = [], None
    for c in client.chat.completions.create(model="smollm2", messages=msgs, max_tokens=12,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True}):
        if c.choices:
            parts.append(c.choices[0].delta.content or "")
        if c.usage:
            usage = c.usage
    assert "".join(parts) == chat.choices[0].message.content
    assert usage.completion_tokens == chat.usage.completion_tokens
    RESULTS.setdefault(name, {})["chat"] = chat.choices[0].message.content


def test_32_concurrent_requests_match_single_requests(server):
    name, client, _ = server
    single = [_greedy(client, p).choices[0].text for p in PROMPTS]
    with cf.ThreadPoolExecutor(32) as ex:
        together = list(ex.map(lambda p: _greedy(client, p).choices[0].text, PROMPTS))
    assert together == single
    RESULTS.setdefault(name, {})["completions"] = single
    other = RESULTS.get("tcp" if name == "auto" else "auto")
    if other and "completions" in other:  # the second transport to run compares
        assert single == other["completions"]  # tcp outputs identical to shm outputs


def test_errors_are_openai_style_4xx_and_the_server_keeps_serving(server):
    _, client, port = server
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="nope", prompt="x", max_tokens=2)
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError, match="top_p"):
        client.completions.create(model="smollm2", prompt="x", max_tokens=2, top_p=3)
    with pytest.raises(openai.BadRequestError, match="does not fit in the KV capacity"):
        client.completions.create(model="smollm2", prompt="word " * 1100, max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model="smollm2", prompt="x", max_tokens=0)
    bad = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="wrong-key",
                        max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model="smollm2", prompt="x", max_tokens=2)
    import urllib.error
    import urllib.request
    no_key = urllib.request.Request(f"http://127.0.0.1:{port}/v1/models")
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(no_key)
    assert e.value.code == 401 and b"invalid_api_key" in e.value.read()
    assert _greedy(client, "Still serving?").choices[0].text  # keeps serving
    health = urllib.request.urlopen(f"http://127.0.0.1:{port}/health").read()
    assert b"ok" in health
    metrics = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read().decode()
    for name in ("lamina_requests_running", "lamina_requests_waiting", "lamina_kv_slots_used",
                 "lamina_generated_tokens_total", "lamina_time_to_first_token_seconds_bucket",
                 "lamina_time_between_tokens_seconds_bucket"):
        assert name in metrics


def _titled(title: str) -> list[int]:
    """Pids of processes titled ``title`` that are lamina launch or its Ray workers."""
    found = []
    for p in psutil.process_iter(["cmdline"]):
        if " ".join(p.info["cmdline"] or []).strip() != title:
            continue
        try:
            parent = " ".join(p.parent().cmdline())
        except (psutil.Error, AttributeError):
            continue
        if "raylet" in parent or title == "lamina: server":
            found.append(p.pid)
    return found


def test_roles_are_named_and_a_killed_role_loses_no_request(server):
    """Every process names its role in ps; kill -9 of a role's actor mid-generation (a memory
    node on the shm deployment, a compute replica on the tcp one): every stream completes with
    the unfaulted text and the server keeps serving."""
    name, client, port = server
    victim = "lamina: memory node 1" if name == "auto" else "lamina: replica 1"
    for title in ("lamina: server", "lamina: replica 0", "lamina: replica 1",
                  "lamina: memory node 0", "lamina: memory node 1"):
        assert len(_titled(title)) == 1, title
    prompts = PROMPTS[:4]
    kw = dict(model="smollm2", max_tokens=48, temperature=0)
    want = [client.completions.create(prompt=p, **kw).choices[0].text for p in prompts]
    started = threading.Event()

    def stream(p: str) -> str:
        parts = []
        for c in client.completions.create(prompt=p, stream=True, **kw):
            parts.append(c.choices[0].text if c.choices else "")
            started.set()
        return "".join(parts)

    with cf.ThreadPoolExecutor(len(prompts)) as ex:
        futures = [ex.submit(stream, p) for p in prompts]
        assert started.wait(120)
        os.kill(_titled(victim)[0], signal.SIGKILL)
        got = [f.result(timeout=600) for f in futures]
    assert got == want
    assert _greedy(client, "Still serving?").choices[0].text
    assert b"ok" in urllib.request.urlopen(f"http://127.0.0.1:{port}/health").read()
