"""The seam that starts node processes: multiprocessing now, Ray with ``lamina launch``.

A launcher starts ``target(*args)`` in a new process and returns a handle with ``pid``,
``is_alive()``, ``join(timeout)``, ``terminate()`` and ``kill()`` (``multiprocessing.Process``
has exactly these). ``args`` are control-plane setup (channel specs, node config), never
tensors.
"""
from __future__ import annotations

import multiprocessing
from typing import Any, Callable, Protocol

from lamina.omp import warn_if_spinning


class ProcessHandle(Protocol):
    pid: int | None

    def is_alive(self) -> bool: ...

    def join(self, timeout: float | None = None) -> None: ...

    def terminate(self) -> None: ...

    def kill(self) -> None: ...


class Launcher(Protocol):
    def start(self, target: Callable[..., Any], args: tuple, name: str) -> ProcessHandle: ...


class MultiprocessingLauncher:
    """Start node processes with the ``spawn`` context (safe with threads and CUDA)."""

    def __init__(self) -> None:
        self.ctx = multiprocessing.get_context("spawn")

    def start(self, target: Callable[..., Any], args: tuple, name: str) -> ProcessHandle:
        warn_if_spinning()
        p = self.ctx.Process(target=target, args=args, name=name, daemon=True)
        p.start()
        return p


def stop_process(p: ProcessHandle, timeout: float = 5.0) -> None:
    """Wait for ``p`` to exit, then terminate, then kill: no orphan survives."""
    p.join(timeout)
    if p.is_alive():
        p.terminate()
        p.join(timeout)
    if p.is_alive():
        p.kill()
        p.join(timeout)
