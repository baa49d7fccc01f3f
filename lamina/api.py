"""The Python API: ``LLM(...)``, ``generate``, ``generate_stream``, ``chat`` (vLLM-like).

>>> from lamina import LLM, SamplingParams
>>> with LLM("smollm2", memory=2) as llm:
...     out = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=8))
...     print(out[0].outputs[0].text)

Memory nodes run in this process (``transport="local"``) or as separate OS processes on this
host (``transport="shm"``: shared-memory rings). A bad request (empty prompt, prompt longer than
all pools together, token ids out of range) gets its ``RequestOutput.error`` set to a clear
``ValueError`` and the rest of the call completes. Invalid ``SamplingParams`` raise ValueError
when constructed. A memory node that dies raises :class:`~lamina.pool.NodeFailure` and the
``LLM`` shuts every node down.
"""
from __future__ import annotations

from typing import Iterator, Sequence

import torch
from tqdm.auto import tqdm

from lamina.computenode.replica import ComputeReplica
from lamina.computenode.sampling import Sampler
from lamina.engine import Engine
from lamina.models import load_model
from lamina.nodes import MemoryPoolHandle, start_memory_pool
from lamina.outputs import CompletionOutput, RequestOutput, StreamDelta, output_text, stable_text
from lamina.pipeline import resolve_pipeline
from lamina.pool import NodeFailure
from lamina.request import Request
from lamina.scheduler import SchedulerConfig
from lamina.splitter import split_model
from lamina.timeline import Timeline
from lamina.types import SamplingParams
from lamina.worker import LocalWorker, ReplicaWorker

Prompt = str | list[int]


class LLM:
    """An instance: one engine, ``compute`` replicas and ``memory`` memory nodes.

    ``kv_cache_gb`` is the KV budget per memory node (``kv_cache_tokens`` overrides it with an
    exact slot count per node). ``dtype`` defaults to float32 on CPU and bfloat16 on CUDA;
    ``memory_device`` defaults to ``device``. ``micro_batches`` in flight under ``pipeline``
    (``none``, ``fixed``, ``rotational``; defaults in :func:`lamina.pipeline.resolve_pipeline`:
    rotational with ``compute + 1`` micro-batches when ``compute > 1``); ``attn_parts`` splits each
    node's share of a layer into that many mini-batches (communication-attention overlap). The
    compute replicas run in this process on ``device`` and share its weights, or, with
    ``compute_processes=True`` (needs ``transport="shm"``), each in its own process with its
    own weights: memory nodes then reply to the replica that runs the next slice and contexts
    move replica to replica (:mod:`lamina.replica_procs`). ``trace``: write a Chrome/Perfetto
    timeline JSON there on :meth:`close`.
    """

    def __init__(self, model: str = "smollm2", compute: int = 1, memory: int = 1,
                 device: str = "cpu", memory_device: str | None = None,
                 kv_cache_gb: float = 1.0, kv_cache_tokens: int | None = None,
                 dtype: torch.dtype | None = None, transport: str = "local",
                 max_num_seqs: int = 64, max_num_batched_tokens: int = 512,
                 slab_size: int = 256, micro_batches: int | None = None,
                 pipeline: str | None = None, attn_parts: int = 1, trace: str | None = None,
                 compute_processes: bool = False):
        self.pipeline = resolve_pipeline(pipeline, micro_batches, compute, attn_parts)
        if memory < 1:
            raise ValueError(f"memory must be >= 1, got {memory}")
        if compute_processes and transport != "shm":
            raise ValueError("compute_processes=True needs transport='shm' (memory nodes in "
                             "processes that the replicas reach directly)")
        loaded = load_model(model, dtype=dtype, device=device)
        self.tokenizer = loaded.tokenizer
        self.model_name = str(model)
        self.split = split_model(loaded.model)
        cfg = getattr(loaded.model, "config", None)
        self.pool: MemoryPoolHandle = start_memory_pool(
            self.split.specs, memory, transport=transport, device=memory_device or device,
            dtype=loaded.dtype, kv_cache_gb=kv_cache_gb, kv_cache_tokens=kv_cache_tokens,
            slab_size=slab_size)
        max_len = getattr(cfg, "max_position_embeddings", None)
        self.trace_path = trace
        self.timeline = Timeline() if trace else None
        if compute_processes:
            from lamina.replica_procs import ProcessReplicas
            worker = ProcessReplicas(str(model), self.pool.clients, self.pipeline,
                                     num_slices=len(self.split.slices), device=device,
                                     dtype=str(loaded.dtype).removeprefix("torch."),
                                     timeline=self.timeline)
            self.pool.closers.append(worker.close)  # replicas stop before the nodes
        else:
            sampler = Sampler()
            replicas = [ComputeReplica(self.split, device, sampler) for _ in range(compute)]
            worker = LocalWorker(ReplicaWorker(replicas, self.pool.clients, self.pipeline,
                                               self.timeline))
        self.engine = Engine(worker, self.pool.capacities,
                             SchedulerConfig(max_num_seqs, max_num_batched_tokens, max_len),
                             eos_token_ids=_eos_ids(loaded.model, self.tokenizer),
                             tokenizer=self.tokenizer,
                             vocab_size=getattr(cfg, "vocab_size", None))

    # -- lifecycle -----------------------------------------------------------------------------
    def close(self) -> None:
        """Stop every memory node (no orphan processes). Safe to call twice."""
        pool = getattr(self, "pool", None)
        if pool is not None:
            pool.close()
        if getattr(self, "timeline", None) is not None and self.timeline.spans:
            self.timeline.save(self.trace_path)

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    # -- generation ------------------------------------------------------------------------------
    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate for every prompt (text or token ids), batched together; outputs keep the
        prompts' order."""
        outputs: dict[int, RequestOutput] = {}
        for delta in self._run(prompts, sampling_params, use_tqdm):
            pass
        for index, (req, prompt, error) in enumerate(self._last):
            outputs[index] = self._output(req, prompt, error)
        return [outputs[i] for i in range(len(outputs))]

    def generate_stream(self, prompts: Prompt | Sequence[Prompt],
                        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None
                        ) -> Iterator[StreamDelta]:
        """Yield a :class:`StreamDelta` whenever a request gets new text, and one when it ends."""
        yield from self._run(prompts, sampling_params, use_tqdm=False)

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True) -> list[RequestOutput]:
        """Apply the tokenizer's chat template to one conversation (a list of
        ``{"role", "content"}``) or a list of them, then generate."""
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(f"model {self.model_name} has no chat template")
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=False)
                   for c in convs]
        return self.generate(prompts, sampling_params, use_tqdm)

    # -- internals -------------------------------------------------------------------------------
    def _tokenize(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"model {self.model_name} has no tokenizer: pass token ids")
            return self.tokenizer(prompt, add_special_tokens=False).input_ids
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            return list(prompt)
        raise ValueError(f"a prompt must be a string or a list of token ids, got {type(prompt).__name__}")

    def _run(self, prompts, sampling_params, use_tqdm: bool) -> Iterator[StreamDelta]:
        if self.pool.closed:
            raise RuntimeError("this LLM is closed (close() was called or a memory node failed)")
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts
                                        and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
        entries: list[tuple[Request | None, Prompt, Exception | None]] = []
        for prompt, p in zip(prompts, params):
            try:
                entries.append((self.engine.add_request(self._tokenize(prompt), p), prompt, None))
            except ValueError as e:
                entries.append((None, prompt, e))
        self._last = entries
        index_of = {req.req_id: i for i, (req, _, _) in enumerate(entries) if req is not None}
        for i, (req, _, err) in enumerate(entries):
            if err is not None:
                yield StreamDelta(-1, i, [], "", True, "error", err)
        sent_tokens = {rid: 0 for rid in index_of}
        sent_text = {rid: "" for rid in index_of}
        live = set(index_of)
        bar = tqdm(total=len(live), desc="generate", disable=not use_tqdm or not live, unit="req")
        failed = False
        try:
            while live:
                try:
                    step = self.engine.step()
                except NodeFailure:
                    failed = True
                    self.close()  # the pool is unusable: stop every node, leave no orphans
                    raise
                touched = set(step.new_tokens) | {r.req_id for r in step.finished}
                for rid in sorted(touched & live):
                    req = self.engine.requests[rid]
                    text = stable_text(req, self.tokenizer)
                    new_ids = req.output_ids[sent_tokens[rid]:]
                    delta = text[len(sent_text[rid]):] if text.startswith(sent_text[rid]) else ""
                    sent_tokens[rid], sent_text[rid] = len(req.output_ids), text
                    if req.finished:
                        live.discard(rid)
                        bar.update(1)
                    if new_ids or delta or req.finished:
                        yield StreamDelta(rid, index_of[rid], new_ids, delta, req.finished,
                                          req.finish_reason, req.error)
                if not step.new_tokens and not step.finished and not self.engine.has_work():
                    break
        finally:
            bar.close()
            if not failed:
                for rid in live:  # generator closed early: drop what is left
                    self.engine.abort(self.engine.requests[rid], RuntimeError("cancelled"))
            for rid in index_of:
                self.engine.requests.pop(rid, None)

    def _output(self, req: Request | None, prompt: Prompt, error: Exception | None) -> RequestOutput:
        text_prompt = prompt if isinstance(prompt, str) else None
        if req is None:
            ids = list(prompt) if isinstance(prompt, (list, tuple)) else []
            return RequestOutput(-1, text_prompt, ids, [CompletionOutput(0, "", [], "error")],
                                 True, error)
        comp = CompletionOutput(0, output_text(req, self.tokenizer), list(req.output_ids),
                                req.finish_reason)
        return RequestOutput(req.req_id, text_prompt, list(req.prompt_ids), [comp], req.finished,
                             req.error)


def _eos_ids(model: torch.nn.Module, tokenizer) -> set[int]:
    ids: set[int] = set()
    for src in (getattr(model, "generation_config", None), getattr(model, "config", None), tokenizer):
        e = getattr(src, "eos_token_id", None)
        if isinstance(e, int):
            ids.add(e)
        elif isinstance(e, (list, tuple)):
            ids.update(int(x) for x in e)
        if ids:
            break
    return ids
