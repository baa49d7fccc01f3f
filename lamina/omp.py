"""The OpenMP wait policy of the processes that run Lamina.

torch's intra-op thread pool (libgomp on Linux) keeps its worker threads spinning for a while
after every parallel op (milliseconds on AMD CPUs) before they sleep. Which is right depends on
who owns the cores:

* **The process that imports lamina** keeps libgomp's default. In process, it *is* the compute
  role and owns its cores: a decode step runs ~200 parallel linear layers a few microseconds
  apart, and a sleeping worker takes 50-200 us to wake on these VMs, so ``PASSIVE`` there cost
  SmolLM2's in-process decode on two cores ~33 ms a token against ~20 with the default
  (README, "Dense slices on CPU"). Under ``procs`` it is the engine, which runs no parallel
  ops while it serves.
* **Role processes** that Lamina spawns (memory nodes, compute replicas) start with
  ``OMP_WAIT_POLICY=PASSIVE``: on a few cores their spinning workers would take the cores the
  other roles need (``bench/e2e.py``). :func:`for_roles` sets it in this process's
  environment, which they inherit, before the first starts; libgomp reads it once, when torch
  loads, so this process (torch loaded by then) keeps its own policy.

A policy the user chose (any of :data:`WAIT_VARS` set when lamina was imported) is left alone
everywhere.
"""
from __future__ import annotations

import os

WAIT_VARS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")
_state = {"chosen": False}


def remember_choice() -> None:
    """Note whether the user chose a wait policy (called once, by ``import lamina``)."""
    _state["chosen"] = any(v in os.environ for v in WAIT_VARS)


def for_roles() -> None:
    """Before starting role processes: ``OMP_WAIT_POLICY=PASSIVE`` in the environment they
    inherit, unless the user chose a policy. Left set (starts may come from several threads);
    this process's libgomp has read its policy already, when torch loaded."""
    if not _state["chosen"]:
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
