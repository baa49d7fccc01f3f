"""The errors a user of Lamina can catch (plain classes; every layer may import them)."""
from __future__ import annotations


class NodeFailure(RuntimeError):
    """A memory node or a compute replica died or stopped answering; the message names it."""
