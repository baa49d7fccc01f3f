"""OpenAI-compatible HTTP server (FastAPI + uvicorn) over an :class:`AsyncEngine`.

Endpoints: ``/v1/completions`` and ``/v1/chat/completions`` (streaming as server-sent events
and non-streaming, with usage counts), ``/v1/models``, ``/health``, ``/metrics`` (Prometheus).
Errors are OpenAI-style JSON ``{"error": {"message", "type", "param", "code"}}`` with a 4xx
status; the server keeps serving. With an API key set, every ``/v1`` route needs
``Authorization: Bearer KEY``.
"""
from __future__ import annotations

import json
import secrets
import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict

from lamina.server.async_engine import AsyncEngine
from lamina.server.metrics import render_metrics
from lamina.types import SamplingParams


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.type, self.param, self.code = status, type_, param, code

    def response(self) -> JSONResponse:
        return JSONResponse({"error": {"message": str(self), "type": self.type,
                                       "param": self.param, "code": self.code}},
                            status_code=self.status)


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
        loc = ".".join(str(x) for x in first.get("loc", ()) if x != "body")
        return APIError(400, f"invalid request: {loc}: {first.get('msg', e)}", param=loc or None).response()

    @app.middleware("http")
    async def _auth(request: Request, call_next):
        if api_key and request.url.path.startswith("/v1"):
            got = request.headers.get("authorization", "")
            if not secrets.compare_digest(got, f"Bearer {api_key}"):
                return APIError(401, "missing or wrong API key", "authentication_error",
                                code="invalid_api_key").response()
        return await call_next(request)

    @app.get("/health")
    async def health():
        if not engine.healthy:
            return JSONResponse({"status": "failed"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(render_metrics(engine.metrics),
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

    async def run(prompt_ids, params, stream: bool, include_usage: bool, make_chunk, make_final):
        rid = secrets.token_hex(12)
        gen = engine.generate(prompt_ids, params)
        try:
            first = await gen.__anext__()  # surfaces ValueError before any byte is sent
        except ValueError as e:
            raise APIError(400, str(e), param="prompt") from e
        except RuntimeError as e:
            raise APIError(503, str(e), "server_error") from e

        def usage(n_out: int) -> dict:
            return {"prompt_tokens": len(prompt_ids), "completion_tokens": n_out,
                    "total_tokens": len(prompt_ids) + n_out}

        if not stream:
            text, n_out, reason, delta = "", 0, None, first
            while True:
                text += delta.text
                n_out += len(delta.token_ids)
                if delta.finished:
                    reason = delta.finish_reason
                    break
                delta = await gen.__anext__()
            return make_final(rid, text, reason, usage(n_out))

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
            except RuntimeError as e:
                yield _sse({"error": {"message": str(e), "type": "server_error"}})
            finally:
                await gen.aclose()

        return StreamingResponse(sse(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest):
        params = params_of(req, req.max_tokens)
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
        return await run(prompt_ids, params, req.stream, include, chunk, final)

    @app.post("/v1/chat/completions")
    async def chat(req: ChatRequest):
        params = params_of(req, req.max_completion_tokens or req.max_tokens)
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
        return await run(prompt_ids, params, req.stream, include, chunk, final)

    return app


def _content(content) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    parts = [p.get("text", "") for p in content if p.get("type") == "text"]
    if len(parts) != len(content):
        raise APIError(400, "only text content parts are supported", param="messages")
    return "".join(parts)


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"
