"""OpenAI-compatible HTTP server (FastAPI + uvicorn) over an :class:`AsyncEngine`.

Endpoints: ``/v1/completions`` and ``/v1/chat/completions`` (streaming as server-sent events
and non-streaming, with usage counts), ``/v1/models``, ``/health``, ``/metrics`` (Prometheus).
Every error, including unknown routes, malformed bodies and internal errors, is OpenAI-style
JSON ``{"error": {"message", "type", "param", "code"}}``; the server keeps serving.

Limits: a prompt that alone does not fit the context or the memory nodes' KV, or whose
``max_tokens`` would take it past the context, is a 400 (``context_length_exceeded``, as vLLM
answers); without ``max_tokens`` the default (16) is capped to what fits; when ``max_open`` requests
are already open the answer is 429 with ``Retry-After``. A client that disconnects aborts its
request (streaming or not) and its KV is freed.

With an API key set, every ``/v1`` route needs ``Authorization: Bearer KEY``; ``/health`` and
``/metrics`` stay open (as in vLLM: probes and Prometheus scrapers carry no key; the server
binds 127.0.0.1 unless told otherwise).
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import secrets
import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict
from starlette.exceptions import HTTPException as StarletteHTTPException

from lamina.errors import ContextLengthExceeded, NoCapacity
from lamina.server.async_engine import AsyncEngine, Overloaded
from lamina.server.metrics import MetricsExporter
from lamina.types import SamplingParams


log = logging.getLogger("lamina.server")
RETRY_AFTER_S = 1
DISCONNECT_POLL_S = 0.2


class APIError(Exception):
    """An error answered as OpenAI-style JSON with HTTP ``status`` (and optional headers)."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.type, self.param, self.code = status, type_, param, code
        self.headers = headers

    def response(self) -> JSONResponse:
        return JSONResponse({"error": {"message": str(self), "type": self.type,
                                       "param": self.param, "code": self.code}},
                            status_code=self.status, headers=self.headers)


class _Common(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    n: int = 1
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    ignore_eos: bool = False


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str] | list[list[int]]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatRequest(_Common):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None


def build_app(engine: AsyncEngine, tokenizer, model_name: str, api_key: str | None = None,
              max_model_len: int | None = None) -> FastAPI:
    app = FastAPI(title="lamina", version="0.1.0")
    created = int(time.time())

    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError):
        return e.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, e: RequestValidationError):
        first = e.errors()[0] if e.errors() else {}
        if first.get("type") == "json_invalid":  # loc is ("body", character offset)
            return APIError(400, f"the request body is not valid JSON: {first.get('msg')} "
                                 f"(at character {first.get('loc', ('', '?'))[-1]})").response()
        loc = ".".join(str(x) for x in first.get("loc", ()) if x != "body")
        if not loc:
            return APIError(400, f"the request body must be a JSON object ({first.get('msg', e)})"
                            ).response()
        return APIError(400, f"invalid request: {loc}: {first.get('msg', e)}",
                        param=loc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, e: StarletteHTTPException):
        type_ = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return APIError(e.status_code, str(e.detail), type_, headers=e.headers).response()

    @app.exception_handler(Exception)
    async def _internal(_: Request, e: Exception):
        log.exception("internal error")
        return APIError(500, f"internal error: {type(e).__name__}: {e}", "server_error").response()

    if api_key:
        app.add_middleware(_RequireKey, api_key=api_key)

    @app.get("/health")
    async def health():
        if not engine.healthy:
            return JSONResponse({"status": "failed"}, status_code=503)
        if engine.recovering:  # a role died; its instance is being restarted
            return JSONResponse({"status": "recovering"}, status_code=503)
        if not engine.serving:  # every instance lost a role; restarts are being retried
            return JSONResponse({"status": "no_capacity"}, status_code=503)
        return {"status": "ok"}

    exporter = MetricsExporter()

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(exporter.render(engine.metrics),
                                 media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model",
                                            "created": created, "owned_by": "lamina",
                                            "max_model_len": max_model_len}]}

    def params_of(req: _Common, max_tokens: int | None) -> SamplingParams:
        if req.model != model_name:
            raise APIError(404, f"model '{req.model}' does not exist; this server serves "
                                f"'{model_name}'", param="model", code="model_not_found")
        if req.n != 1:
            raise APIError(400, "only n=1 is supported", param="n")
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        try:
            return SamplingParams(temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
                                  seed=req.seed, max_tokens=16 if max_tokens is None else max_tokens, stop=stop,
                                  ignore_eos=req.ignore_eos)
        except ValueError as e:
            raise APIError(400, str(e)) from e

    def tokenize(text: str) -> list[int]:
        if tokenizer is None:
            raise APIError(400, "this model has no tokenizer: send token ids", param="prompt")
        return tokenizer(text, add_special_tokens=False).input_ids

    def fit_context(prompt_ids: list[int], params: SamplingParams, asked: bool) -> SamplingParams:
        """400 if the prompt alone, or with the ``max_tokens`` the client ``asked`` for, exceeds
        the context (as vLLM answers); the default ``max_tokens`` is capped to what fits."""
        if max_model_len is None:
            return params
        room = max_model_len - len(prompt_ids)
        if room <= 0:
            raise APIError(400, f"the prompt has {len(prompt_ids)} tokens; this model's maximum "
                                f"context length is {max_model_len} tokens", param="prompt",
                           code="context_length_exceeded")
        if asked and params.max_tokens > room:
            raise APIError(400, str(ContextLengthExceeded(max_model_len, len(prompt_ids),
                                                          params.max_tokens)),
                           param="max_tokens", code="context_length_exceeded")
        return dataclasses.replace(params, max_tokens=min(params.max_tokens, room))

    async def run(raw: Request, prompt_ids, params, asked: bool, stream: bool,
                  include_usage: bool, make_chunk, make_final):
        rid = secrets.token_hex(12)
        gen = engine.generate(prompt_ids, fit_context(prompt_ids, params, asked))
        try:
            first = await gen.__anext__()  # surfaces ValueError before any byte is sent
        except ContextLengthExceeded as e:  # the engine's own context (the server's may be None)
            raise APIError(400, str(e), param="max_tokens", code="context_length_exceeded") from e
        except ValueError as e:
            raise APIError(400, str(e), param="prompt") from e
        except Overloaded as e:
            raise APIError(429, str(e), "rate_limit_error", code="server_busy",
                           headers={"Retry-After": str(RETRY_AFTER_S)}) from e
        except NoCapacity as e:  # every instance lost a role; restarts are being retried
            raise APIError(503, str(e), "server_error", code="service_unavailable",
                           headers={"Retry-After": str(max(1, round(e.retry_after_s)))}) from e
        except RuntimeError as e:
            raise APIError(503, str(e), "server_error", code="service_unavailable") from e

        def usage(n_out: int) -> dict:
            return {"prompt_tokens": len(prompt_ids), "completion_tokens": n_out,
                    "total_tokens": len(prompt_ids) + n_out,
                    "prompt_tokens_details": {"cached_tokens": first.num_cached_tokens}}

        if not stream:
            async def collect() -> dict:
                text, n_out, delta = "", 0, first
                while True:
                    text += delta.text
                    n_out += len(delta.token_ids)
                    if delta.finished:
                        return make_final(rid, text, delta.finish_reason, usage(n_out))
                    delta = await gen.__anext__()

            try:
                return await _unless_disconnected(raw, collect())
            except RuntimeError as e:
                raise APIError(503, str(e), "server_error", code="service_unavailable") from e
            finally:
                await gen.aclose()  # a no-op when finished; else aborts and frees the KV

        async def sse():
            n_out, delta = 0, first
            try:
                yield _sse(make_chunk(rid, None, None, start=True))
                while True:
                    n_out += len(delta.token_ids)
                    if delta.text or delta.finished:
                        yield _sse(make_chunk(rid, delta.text,
                                              delta.finish_reason if delta.finished else None))
                    if delta.finished:
                        break
                    delta = await gen.__anext__()
                if include_usage:
                    chunk = make_chunk(rid, None, None)
                    chunk["choices"], chunk["usage"] = [], usage(n_out)
                    yield _sse(chunk)
                yield "data: [DONE]\n\n"
            except RuntimeError as e:  # the stream ends properly even when the engine fails
                yield _sse({"error": {"message": str(e), "type": "server_error", "param": None,
                                      "code": "service_unavailable"}})
                yield "data: [DONE]\n\n"
            finally:
                await gen.aclose()

        return StreamingResponse(sse(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, raw: Request):
        params = params_of(req, req.max_tokens)
        asked = req.max_tokens is not None
        p = req.prompt
        if isinstance(p, list) and p and not isinstance(p[0], int):
            if len(p) != 1:
                raise APIError(400, "batched prompts are not supported; send one prompt",
                               param="prompt")
            p = p[0]
        prompt_ids = tokenize(p) if isinstance(p, str) else list(p)
        now = int(time.time())

        def chunk(rid, text, reason, start=False):
            if start:
                return {"id": f"cmpl-{rid}", "object": "text_completion", "created": now,
                        "model": model_name, "choices": [{"index": 0, "text": "",
                                                          "logprobs": None, "finish_reason": None}]}
            return {"id": f"cmpl-{rid}", "object": "text_completion", "created": now,
                    "model": model_name, "choices": [{"index": 0, "text": text or "",
                                                      "logprobs": None, "finish_reason": reason}]}

        def final(rid, text, reason, usage):
            return {"id": f"cmpl-{rid}", "object": "text_completion", "created": now,
                    "model": model_name, "choices": [{"index": 0, "text": text, "logprobs": None,
                                                      "finish_reason": reason}], "usage": usage}

        include = bool((req.stream_options or {}).get("include_usage"))
        return await run(raw, prompt_ids, params, asked, req.stream, include, chunk, final)

    @app.post("/v1/chat/completions")
    async def chat(req: ChatRequest, raw: Request):
        max_tokens = req.max_completion_tokens or req.max_tokens
        params, asked = params_of(req, max_tokens), max_tokens is not None
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise APIError(400, f"model '{model_name}' has no chat template", param="messages")
        msgs = [{"role": m.role, "content": _content(m.content)} for m in req.messages]
        try:
            text = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        except Exception as e:
            raise APIError(400, f"cannot apply the chat template: {e}", param="messages") from e
        prompt_ids = tokenize(text)
        now = int(time.time())

        def chunk(rid, text, reason, start=False):
            delta = {"role": "assistant", "content": ""} if start else \
                ({"content": text} if text else {})
            return {"id": f"chatcmpl-{rid}", "object": "chat.completion.chunk", "created": now,
                    "model": model_name, "choices": [{"index": 0, "delta": delta,
                                                      "logprobs": None, "finish_reason": reason}]}

        def final(rid, text, reason, usage):
            return {"id": f"chatcmpl-{rid}", "object": "chat.completion", "created": now,
                    "model": model_name,
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                 "logprobs": None, "finish_reason": reason}], "usage": usage}

        include = bool((req.stream_options or {}).get("include_usage"))
        return await run(raw, prompt_ids, params, asked, req.stream, include, chunk, final)

    return app


class _RequireKey:
    """ASGI middleware: ``/v1`` routes need ``Authorization: Bearer KEY`` (a plain ASGI layer,
    so handlers still see the client's disconnect)."""

    def __init__(self, app, api_key: str) -> None:
        self.app, self.want = app, f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            got = dict(scope["headers"]).get(b"authorization", b"")
            if not secrets.compare_digest(got, self.want):
                await APIError(401, "missing or wrong API key", "authentication_error",
                               code="invalid_api_key").response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


async def _unless_disconnected(raw: Request, work) -> Any:
    """Await ``work``; if the client disconnects first, cancel it (which aborts its request)."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await raw.is_disconnected():
                task.cancel()
                raise APIError(499, "the client disconnected", code="client_closed_request")
    finally:
        task.cancel()


def _content(content) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    parts = [p.get("text", "") for p in content if p.get("type") == "text"]
    if len(parts) != len(content):
        raise APIError(400, "only text content parts are supported", param="messages")
    return "".join(parts)


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"
