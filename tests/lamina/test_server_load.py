"""Load: 1,000 concurrent requests on loopback against a real uvicorn server (the app
``lamina launch`` serves, over an in-process deployment of a tiny llama without a tokenizer):
0 lost, every one answered 200 with its 4 tokens (issue 20). That concurrent greedy outputs
equal single ones is checked with text in tests/launch."""
import asyncio
import os
import sys
import threading
import time

import httpx
import pytest

uvicorn = pytest.importorskip("uvicorn")
pytest.importorskip("fastapi")

from lamina import LLM
from lamina.server.async_engine import AsyncEngine
from lamina.server.app import build_app

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "splitter"))
from tiny_models import tiny_folder  # noqa: E402

N = 1000
PROMPTS = [[5 + i, 6 + i, 7 + i] for i in range(10)]


def _body(prompt: list[int]) -> dict:
    return {"model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0,
            "ignore_eos": True}


async def _fire(port: int) -> list:
    limits = httpx.Limits(max_connections=N, max_keepalive_connections=N)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", limits=limits,
                                 timeout=600) as http:
        return await asyncio.gather(*(http.post("/v1/completions", json=_body(PROMPTS[i % 10]))
                                      for i in range(N)), return_exceptions=True)


@pytest.mark.slow
def test_a_thousand_concurrent_requests_lose_nothing(tmp_path):
    path = tiny_folder("llama", tmp_path / "llama")
    with LLM(path, memory=2, kv_cache_tokens=2048, max_num_seqs=128) as llm:
        engine = AsyncEngine(llm.deployment)
        app = build_app(engine, None, "tiny", max_model_len=256)
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="error",
                                               backlog=2048))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        try:
            deadline = time.monotonic() + 60
            while not server.started:
                assert time.monotonic() < deadline, "the server did not start"
                time.sleep(0.02)
            port = server.servers[0].sockets[0].getsockname()[1]
            rs = asyncio.run(_fire(port))
        finally:
            server.should_exit = True
            thread.join(timeout=60)
            engine.shutdown()
    errors = [r for r in rs if isinstance(r, Exception) or r.status_code != 200]
    assert errors == [], f"{len(errors)} of {N} failed, e.g. {errors[:3]}"
    for r in rs:
        body = r.json()
        assert body["usage"]["completion_tokens"] == 4
        assert body["choices"][0]["finish_reason"] == "length"
    assert engine.open_requests == 0
