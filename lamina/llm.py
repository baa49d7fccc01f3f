"""The one Python API: ``LLM(...)`` with ``generate``, ``generate_stream`` and ``chat`` (vLLM-like).

>>> from lamina import LLM, SamplingParams
>>> with LLM("smollm2", compute=2, memory=2, placement="procs") as llm:
...     out = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=8))
...     print(out[0].outputs[0].text)

An ``LLM`` is a deployment of ``instances`` instances (each: one engine, ``compute`` replicas,
``memory`` memory nodes) placed ``inproc``, as ``procs`` or on ``ray`` (:mod:`lamina.instance`),
behind one router, with KV borrowing between their pools. A bad request (empty prompt, prompt
longer than every pool together, token ids out of range, ``max_tokens`` past the context) gets
its ``RequestOutput.error`` set to a clear ``ValueError`` and the rest of the call completes.
Invalid ``SamplingParams`` raise ValueError when constructed. A memory node or replica that
dies fails its step with :class:`~lamina.errors.NodeFailure`; the deployment replaces its
instance and the instance's unfinished requests recompute (nothing is lost). If the
replacement cannot start, that instance's requests end with the error, and with no instance
left new requests raise :class:`~lamina.errors.NoCapacity` while restarts are retried.
"""
from __future__ import annotations

from typing import Iterator, Sequence

from tqdm.auto import tqdm

from lamina.config import DeploymentConfig, deployment_config, kernels_in_use, use_kernels
from lamina.deployment import Deployment, start_deployment
from lamina.device import CallerState
from lamina.engine.request import Request
from lamina.errors import NoCapacity, NodeFailure
from lamina.outputs import CompletionOutput, RequestOutput, StreamCursor, StreamDelta, output_text
from lamina.timeline import Timeline
from lamina.types import SamplingParams

Prompt = str | list[int]


class LLM:
    """A served model: see the module docstring.

    ``LLM(model, **settings)``: each setting is a field of the config chain by its name
    (:data:`lamina.config.SETTINGS`, defaults there): ``compute`` replicas and ``memory`` nodes
    per instance, ``instances``, ``placement`` (``inproc``, ``procs``, ``ray``), ``pipeline``
    (``none``, ``fixed``, ``rotational``), ``micro_batches``, ``attn_parts``, ``device`` /
    ``memory_device``, ``dtype``, ``kv_cache_gb`` (or exactly ``kv_cache_tokens``) per memory
    node, ``slab_size``, ``max_num_seqs``, ``max_num_batched_tokens``, ``transport``,
    ``address`` (a running Ray cluster), ``cuda_graphs``, ``device_polling``, ``borrowing``,
    ``plan_every``, ... (:mod:`lamina.config` says what each does). ``config`` gives the whole
    chain instead. ``trace``: write a Chrome/Perfetto timeline JSON there on :meth:`close`.
    """

    def __init__(self, model: str | None = None, *, config: DeploymentConfig | None = None,
                 trace: str | None = None, **settings):
        if config is not None and (model is not None or settings):
            raise TypeError("LLM takes a model and settings, or config=, not both")
        self.config = config or deployment_config(model, **settings)
        self.model_name = self.config.model.model
        self.trace_path = trace
        self.timeline = Timeline() if trace else None
        self.deployment: Deployment | None = None
        # the deployment pins this process's cores and sets its kernels; close() undoes both
        self._caller, self._kernels = CallerState.save(), kernels_in_use()
        try:
            self.deployment = start_deployment(self.config, timeline=self.timeline)
        except BaseException:
            self._restore()
            raise
        self.tokenizer = self.deployment.instances[0].engine.tokenizer

    # -- lifecycle -----------------------------------------------------------------------------
    def close(self) -> None:
        """Stop every role of every instance (no orphan processes) and give the calling process
        back its CPU affinity and torch thread count. Safe to call twice."""
        d, self.deployment = getattr(self, "deployment", None), None
        if d is not None:
            d.close()
            self._restore()
        if getattr(self, "timeline", None) is not None and self.timeline.spans:
            self.timeline.save(self.trace_path)

    def _restore(self) -> None:
        self._caller.restore()
        use_kernels(self._kernels)

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
        for delta in self._run(prompts, sampling_params, use_tqdm, decode=False):
            pass  # the text is decoded once, at the end (_output)
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

    def _run(self, prompts, sampling_params, use_tqdm: bool,
             decode: bool = True) -> Iterator[StreamDelta]:
        """Serve ``prompts`` step by step, yielding each request's deltas. ``decode``: the
        deltas carry their text (else ``""``: the output is not decoded every step, which costs
        a decode of the whole output per step)."""
        d = self.deployment
        if d is None:
            raise RuntimeError("this LLM is closed (close() was called or a role failed)")
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
                entries.append((d.add_request(self._tokenize(prompt), p), prompt, None))
            except (ValueError, NoCapacity) as e:
                entries.append((None, prompt, e))
        self._last = entries
        index_of = {req.req_id: i for i, (req, _, _) in enumerate(entries) if req is not None}
        for i, (req, _, err) in enumerate(entries):
            if err is not None:
                yield StreamDelta(-1, i, [], "", True, "error", err)
        cursors = {rid: StreamCursor() for rid in index_of}
        tokenizer = self.tokenizer if decode else None
        live = set(index_of)
        bar = tqdm(total=len(live), desc="generate", disable=not use_tqdm or not live, unit="req")
        failed = False
        try:
            while live:
                try:
                    step = d.step()
                except NodeFailure:
                    failed = True
                    self.close()  # nothing is left to serve: stop every role, leave no orphans
                    raise
                touched = set(step.new_tokens) | {r.req_id for r in step.finished}
                for rid in sorted(touched & live):
                    req = d.request(rid)
                    new_ids, delta = cursors[rid].advance(req, tokenizer)
                    if req.finished:
                        live.discard(rid)
                        bar.update(1)
                    if new_ids or delta or req.finished:
                        yield StreamDelta(rid, index_of[rid], new_ids, delta, req.finished,
                                          req.finish_reason, req.error)
                if not step.new_tokens and not step.finished and not d.has_work():
                    break
        finally:
            bar.close()
            if not failed:
                for rid in live:  # generator closed early: drop what is left
                    d.abort(d.request(rid), RuntimeError("cancelled"))
                for rid in index_of:
                    d.forget(rid)

    def _output(self, req: Request | None, prompt: Prompt, error: Exception | None) -> RequestOutput:
        text_prompt = prompt if isinstance(prompt, str) else None
        if req is None:
            ids = list(prompt) if isinstance(prompt, (list, tuple)) else []
            return RequestOutput(-1, text_prompt, ids, [CompletionOutput(0, "", [], "error")],
                                 True, error)
        comp = CompletionOutput(0, output_text(req, self.tokenizer), list(req.output_ids),
                                req.finish_reason)
        return RequestOutput(req.req_id, text_prompt, list(req.prompt_ids), [comp], req.finished,
                             req.error, req.num_preemptions, req.num_cached_tokens or 0)

