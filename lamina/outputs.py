"""What ``LLM.generate`` returns (vLLM-compatible shapes) and the text bookkeeping behind it."""
from __future__ import annotations

from dataclasses import dataclass, field

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
    """Decoded output (special tokens skipped), cut before the first stop string if one matched."""
    if tokenizer is None:
        return ""
    text = tokenizer.decode(req.output_ids, skip_special_tokens=True)
    cut = min((text.find(s) for s in req.params.stop if s in text), default=-1)
    return text[:cut] if cut >= 0 else text


def stable_text(req: Request, tokenizer) -> str:
    """Text safe to stream so far: holds back a trailing partial UTF-8 character."""
    text = output_text(req, tokenizer)
    if not req.finished:
        text = text.rstrip("\ufffd")
        # hold back a possible prefix of a stop string
        for s in req.params.stop:
            for k in range(min(len(s) - 1, len(text)), 0, -1):
                if text.endswith(s[:k]):
                    return text[:-k]
    return text


@dataclass
class StreamCursor:
    """How much of one request's output has been streamed: ``tokens`` ids, ``text`` characters."""

    tokens: int = 0
    text: str = ""

    def advance(self, req: Request, tokenizer) -> tuple[list[int], str]:
        """The token ids and text not streamed yet (text as :func:`stable_text` allows), and
        move past them."""
        text = stable_text(req, tokenizer)
        new_ids = req.output_ids[self.tokens:]
        delta = text[len(self.text):] if text.startswith(self.text) else ""
        self.tokens, self.text = len(req.output_ids), text
        return new_ids, delta
