"""The errors a user of Lamina can catch (plain classes; every layer may import them)."""
from __future__ import annotations


class NodeFailure(RuntimeError):
    """A memory node or a compute replica died or stopped answering; the message names it."""


class NoCapacity(RuntimeError):
    """No instance can serve now: each lost a role and could not be restarted (its host or
    resources are gone). New requests are refused with this until a restart, retried every
    few seconds, succeeds (``retry_after_s``)."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class ContextLengthExceeded(ValueError):
    """A request whose prompt and ``max_tokens`` together exceed the model's context length:
    refused before it is queued (as vLLM refuses it), never silently capped."""

    def __init__(self, context: int, prompt_tokens: int, max_tokens: int) -> None:
        super().__init__(
            f"this model's maximum context length is {context} tokens, but {prompt_tokens + max_tokens} "
            f"were requested ({prompt_tokens} in the prompt, {max_tokens} in max_tokens); reduce "
            f"the prompt or max_tokens")
