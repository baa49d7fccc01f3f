"""What ``LLM.generate`` returns (vLLM-compatible shapes) and the text bookkeeping behind it."""
from __future__ import annotations

from dataclasses import dataclass, field

from lamina.engine.detokenize import IncrementalText
from lamina.engine.request import Request


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop" | "length" | "error" | None while running


@dataclass
class RequestOutput:
    """One request's result. ``error`` holds the ValueError (bad input) or other exception that
    ended it; the other requests of the same call are unaffected. ``num_preemptions``: how often
    its KV was dropped for room and recomputed; ``num_cached_tokens``: prompt tokens whose KV
    came from the prefix cache (not computed), as vLLM reports it."""

    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = True
    error: Exception | None = None
    num_preemptions: int = 0
    num_cached_tokens: int = 0


@dataclass
class StreamDelta:
    """What ``generate_stream`` yields: the new tokens/text of one request since the last delta."""

    request_id: int
    index: int  # position of the prompt in the call
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None = None
    error: Exception | None = None
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache


def output_text(req: Request, tokenizer) -> str:
    """Decoded output (special tokens skipped), cut before the first stop string if one matched:
    the whole output decoded once (what a finished request's text is)."""
    if tokenizer is None:
        return ""
    return _cut(tokenizer.decode(req.output_ids, skip_special_tokens=True), req.params.stop)


def _cut(text: str, stop: list[str]) -> str:
    cut = min((text.find(s) for s in stop if s in text), default=-1)
    return text[:cut] if cut >= 0 else text


def stable_text(req: Request, tokenizer, decoded: IncrementalText) -> str:
    """Text safe to stream so far: a running request's from ``decoded`` (its output decoded a
    few tokens at a time, a trailing partial UTF-8 character held back) less a possible prefix
    of a stop string at its end; a finished one's from :func:`output_text`."""
    if tokenizer is None or req.finished:
        return output_text(req, tokenizer)
    decoded.update(req.output_ids, tokenizer)
    text = _cut(decoded.text, req.params.stop)
    for s in req.params.stop:  # hold back a possible prefix of a stop string
        for k in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:k]):
                return text[:-k]
    return text


@dataclass
class StreamCursor:
    """How much of one request's output has been streamed: ``tokens`` ids, ``text`` characters;
    ``decoded``: its output's text so far, decoded incrementally."""

    tokens: int = 0
    text: str = ""
    decoded: IncrementalText = field(default_factory=IncrementalText)

    def advance(self, req: Request, tokenizer) -> tuple[list[int], str]:
        """The token ids and text not streamed yet (text as :func:`stable_text` allows), and
        move past them."""
        text = stable_text(req, tokenizer, self.decoded)
        new_ids = req.output_ids[self.tokens:]
        delta = text[len(self.text):] if text.startswith(self.text) else ""
        self.tokens, self.text = len(req.output_ids), text
        return new_ids, delta
