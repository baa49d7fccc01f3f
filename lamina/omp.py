"""The OpenMP wait policy of processes that run Lamina.

torch's intra-op thread pool (libgomp on Linux) keeps its worker threads spinning after every
parallel op, by default for milliseconds on AMD CPUs. With memory nodes or compute replicas as
processes on a few cores, those spinning threads take the cores the other processes need
(``bench/e2e.py`` measures it; the README has the numbers). So importing :mod:`lamina` sets ``PASSIVE`` unless the user
has chosen a policy (any of :data:`WAIT_VARS`). OpenMP reads it once, when torch loads: it only
takes effect when ``lamina`` is imported before ``torch`` (the ``lamina`` CLI, scripts that start
with ``from lamina import LLM``) or the variable is set in the shell; processes Lamina spawns
inherit it. :func:`warn_if_spinning` says so when it came too late.
"""
from __future__ import annotations

import os
import sys
import warnings

WAIT_VARS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")
_state = {"chosen": False, "in_time": False, "warned": False}


def set_passive_wait() -> None:
    """Default ``OMP_WAIT_POLICY=PASSIVE`` for this process and its children (called once, by
    ``import lamina``); remembers whether the user chose a policy and whether torch had
    already loaded (then this process's threads keep the default)."""
    _state["chosen"] = any(v in os.environ for v in WAIT_VARS)
    _state["in_time"] = "torch" not in sys.modules
    if not _state["chosen"]:
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"


def spinning() -> bool:
    """Whether this process's OpenMP threads may spin by default (nobody chose a policy, and
    torch loaded before lamina could set one)."""
    return not _state["chosen"] and not _state["in_time"]


def warn_if_spinning() -> None:
    """Warn once, when starting node or replica processes, if :func:`spinning`."""
    if spinning() and not _state["warned"]:
        _state["warned"] = True
        warnings.warn("torch was imported before lamina, so this process's OpenMP threads spin "
                      "after each op and can starve Lamina's node processes on few cores; import "
                      "lamina first or set OMP_WAIT_POLICY=PASSIVE (see lamina/omp.py)",
                      RuntimeWarning, stacklevel=3)
