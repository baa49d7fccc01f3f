"""The child side of :mod:`bench.peers`: one engine in one process, run by that engine's Python
(the project's for lamina, a peer's venv for llama.cpp and vLLM) as

    PYTHON bench/peers_child.py SPEC OUT

``SPEC`` (JSON: ``kind``, ``settings``, ``workloads``) says what to run; ``OUT`` gets the
result (JSON), rewritten after each workload. Only the standard library is imported at the top,
so any engine's Python can run it.

How time is measured, the same way for every engine: each engine's child process records, per
request, the wall-clock time (``perf_counter``, relative to the submission) at which each of its
new tokens became visible to the caller:

* lamina: a ``StreamDelta`` yielded by ``LLM.generate_stream`` (one engine step per delta);
* llama.cpp: the low-level API (``llama_decode`` on a ``llama_batch``), as llama.cpp's own
  ``batched`` example and its server with parallel slots do: the prompts' tokens are packed
  into batches of at most ``n_batch`` (2048) tokens across sequences, in order, and each
  sequence's first token is taken (argmax of its logits) after the decode that holds its last
  prompt token; then every step decodes one token of every sequence in one ``llama_decode``;
  a token's time is when its argmax is known. The model loads without llama.cpp's extra
  buffer types (``use_extra_bufts = False``): on a CPU with AMX its default repacks Q4_1 and
  Q8_0 weights for its AMX kernel, which crashed (SIGSEGV in ``ggml_backend_amx_mul_mat``, at
  the first ``llama_decode``) on the 2-core Xeon with AMX in llama-cpp-python 0.3.36; without
  them it runs its AVX-512 kernels, as on any CPU without AMX (float32 weights are not repacked
  either way);
* vLLM: ``LLM.llm_engine.add_request`` for every prompt, then ``llm_engine.step()`` until done
  (what ``LLM.generate`` does inside); a token's time is when the step that returns it returns.

From these times: **TTFT** is the mean over requests of the first token's time; **prefill
end** is the latest first-token time; **decode tok/s** = the new tokens that became visible
after the prefill end / (the last token's time - prefill end). So prefill is everything up to
the moment every request has its first token, decode is what follows; tokens an engine
produced while other prompts were still prefilling (chunked prefill, continuous batching) are
counted in neither. **start-up** is from the child process's start (just before
``Popen``) to its engine being ready to take requests (model loaded, warm-ups the engine does
itself included). Each child then runs one untimed warm-up request (16 tokens -> 4) before the
timed workloads.
"""
from __future__ import annotations

import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

VOCAB = 49152  # SmolLM2's vocabulary; prompts draw ids from [100, VOCAB) (no special tokens)
SEED = 42


def make_prompts(requests: int, prompt_len: int, seed: int = SEED, vocab: int = VOCAB
                 ) -> list[list[int]]:
    """``requests`` prompts of ``prompt_len`` token ids in [100, vocab), the same for a given
    (seed, requests, prompt_len) on every machine and Python."""
    rng = random.Random(f"peers/{seed}/{requests}x{prompt_len}")
    return [[rng.randrange(100, vocab) for _ in range(prompt_len)] for _ in range(requests)]


def summarize(times: list[list[float]]) -> dict:
    """Timing of one workload from each request's token times (seconds after submission)."""
    firsts = [t[0] for t in times if t]
    if len(firsts) != len(times):
        raise ValueError("a request produced no token")
    prefill = max(firsts)
    end = max(t[-1] for t in times)
    decode_tokens = sum(1 for ts in times for t in ts if t > prefill)
    decode_s = end - prefill
    return {"ttft_s": statistics.fmean(firsts), "prefill_s": prefill, "total_s": end,
            "new_tokens": sum(len(t) for t in times), "decode_tokens": decode_tokens,
            "decode_s": decode_s,
            "decode_tok_s": decode_tokens / decode_s if decode_tokens and decode_s > 0 else None}



class Tokens:
    """Token ids and their times (seconds after ``t0``) per request."""

    def __init__(self, n: int) -> None:
        self.t0 = time.perf_counter()
        self.ids: list[list[int]] = [[] for _ in range(n)]
        self.times: list[list[float]] = [[] for _ in range(n)]

    def add(self, i: int, ids: list[int], t: float | None = None) -> None:
        t = (time.perf_counter() if t is None else t) - self.t0
        self.ids[i] += list(ids)
        self.times[i] += [t] * len(ids)

    def result(self) -> dict:
        return {**summarize(self.times), "tokens": self.ids}


def child_lamina(settings: dict):
    from lamina import LLM, SamplingParams  # before torch (lamina sets the OpenMP wait policy)

    llm = LLM("smollm2", **settings)

    def run(prompts: list[list[int]], new: int) -> dict:
        tok = Tokens(len(prompts))
        params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
        for d in llm.generate_stream(prompts, params):
            if d.error is not None:
                raise RuntimeError(f"request {d.index}: {d.error!r}")
            tok.add(d.index, d.token_ids)
        return tok.result()
    return run, llm.close


def child_llamacpp(settings: dict):
    import ctypes

    import llama_cpp as L
    import numpy as np

    state: dict = {"quiet": L.llama_log_callback(lambda *a: None)}  # kept alive: C calls it
    L.llama_log_set(state["quiet"], ctypes.c_void_p())
    L.llama_backend_init()
    params = L.llama_model_default_params()
    params.use_extra_bufts = False  # no AMX repacking: it crashes here (module docstring)
    model = L.llama_model_load_from_file(settings["model"].encode(), params)
    if not model:
        raise RuntimeError(f"llama.cpp cannot load {settings['model']}")
    n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))

    def context(n_seq: int, per_seq: int):
        if state.get("shape") != (n_seq, per_seq):  # one context per workload shape
            if state.get("ctx"):
                L.llama_free(state["ctx"])
            p = L.llama_context_default_params()
            p.n_seq_max, p.n_ctx = n_seq, n_seq * per_seq  # per_seq cells for each sequence
            p.n_threads = p.n_threads_batch = settings["threads"]
            state.update(ctx=L.llama_init_from_model(model, p), shape=(n_seq, per_seq),
                         n_batch=p.n_batch)
        L.llama_memory_clear(L.llama_get_memory(state["ctx"]), True)
        return state["ctx"], state["n_batch"]

    def decode(ctx, items: list[tuple[int, int, int, bool]]) -> list[int]:
        """One llama_decode of (seq, pos, token, wants logits); the argmax of each wanted row."""
        b = L.llama_batch_init(len(items), 0, 1)
        try:
            for i, (s, pos, t, out) in enumerate(items):
                b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = t, pos, 1, out
                b.seq_id[i][0] = s
            b.n_tokens = len(items)
            if L.llama_decode(ctx, b) != 0:
                raise RuntimeError("llama_decode failed (KV cache full?)")
            rows = [i for i, it in enumerate(items) if it[3]]
            return [int(np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, i), (n_vocab,)).argmax())
                    for i in rows]
        finally:
            L.llama_batch_free(b)

    def run(prompts: list[list[int]], new: int) -> dict:
        n, per_seq = len(prompts), -(-(max(map(len, prompts)) + new) // 256) * 256
        ctx, n_batch = context(n, per_seq)
        tok = Tokens(n)
        flat = [(s, pos, t, pos == len(p) - 1) for s, p in enumerate(prompts) for pos, t in enumerate(p)]
        for k in range(0, len(flat), n_batch):  # prefill: prompts packed into n_batch chunks
            chunk = flat[k:k + n_batch]
            for (s, *_), t in zip([c for c in chunk if c[3]], decode(ctx, chunk)):
                tok.add(s, [t])
        for step in range(1, new):  # decode: one token of every sequence per llama_decode
            items = [(s, len(prompts[s]) + step - 1, tok.ids[s][-1], True) for s in range(n)]
            nxt = decode(ctx, items)
            t = time.perf_counter()
            for s in range(n):
                tok.add(s, [nxt[s]], t)
        return tok.result()

    def close() -> None:
        if state.get("ctx"):
            L.llama_free(state["ctx"])
        L.llama_model_free(model)
    return run, close


def child_vllm(settings: dict):
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    # gpu_memory_utilization is the share of the host's RAM vLLM's CPU backend reserves (weights
    # + KV); its default, 0.92, is refused when anything else holds memory
    llm = LLM(model=settings["model"], dtype="float32", enable_prefix_caching=False, seed=0,
              gpu_memory_utilization=settings.get("memory_utilization", 0.25))
    engine = llm.llm_engine
    counter = iter(range(1 << 30))

    def run(prompts: list[list[int]], new: int) -> dict:
        params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
        tok = Tokens(len(prompts))
        index = {}
        for i, p in enumerate(prompts):
            rid = f"r{next(counter)}"
            index[rid] = i
            engine.add_request(rid, TokensPrompt(prompt_token_ids=p), params)
        seen = [0] * len(prompts)
        while engine.has_unfinished_requests():
            outs = engine.step()
            t = time.perf_counter()
            for o in outs:
                i = index[o.request_id]
                ids = list(o.outputs[0].token_ids)  # cumulative
                tok.add(i, ids[seen[i]:], t)
                seen[i] = len(ids)
        return tok.result()
    return run, lambda: None


CHILDREN = {"lamina": child_lamina, "llamacpp": child_llamacpp, "vllm": child_vllm}


def child_main(spec_path: str, out_path: str) -> None:
    """Run one engine: start it, say when it is ready, warm it up, run every workload, writing
    the result file after each (a crash keeps what was done)."""
    spec = json.loads(Path(spec_path).read_text())
    result: dict = {"workloads": {}}

    def save() -> None:
        tmp = out_path + ".tmp"
        Path(tmp).write_text(json.dumps(result))
        os.replace(tmp, out_path)

    run, close = CHILDREN[spec["kind"]](spec["settings"])
    result["ready"] = time.time()
    save()
    try:
        t = time.perf_counter()
        run(make_prompts(1, 16, seed=0), 4)  # warm-up, untimed
        result["warmup_s"] = time.perf_counter() - t
        for w, (n, p, new) in spec["workloads"].items():
            try:
                result["workloads"][w] = run(make_prompts(n, p), new)
            except Exception as e:
                result["workloads"][w] = {"error": f"{type(e).__name__}: {e}"}
            save()
    finally:
        close()
    save()



if __name__ == "__main__":
    child_main(sys.argv[1], sys.argv[2])
