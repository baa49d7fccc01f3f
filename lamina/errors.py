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
