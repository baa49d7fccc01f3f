"""Where a role runs: the launcher seam of a placement.

A launcher starts a role's entry point ``target(endpoint, config)`` (the memory-node server or
the compute-replica server) somewhere and returns a :class:`RoleHandle`: ``pid``,
``is_alive()``, ``join(timeout)``, ``terminate()``, ``kill()`` and ``where`` (``{"node_id",
"ip"}``, the host it runs on). ``procs`` starts OS processes (:class:`ProcessLauncher`),
``ray`` Ray actors (:class:`lamina.instance.ray_actors.RayLauncher`). Arguments are
control-plane set-up (an endpoint, a plain-data config), never tensors.

:meth:`Launcher.control_link` says which backend the engine's own channel to a role uses
(the engine opens it before the role exists): shm on one host, tcp bound to the engine's
address when roles may land on other hosts.
"""
from __future__ import annotations

import atexit
import importlib
import multiprocessing
import multiprocessing.forkserver
import os
from typing import Any, Callable, Protocol

from lamina import omp
from lamina.proctitle import set_title

LOCAL = {"node_id": "local", "ip": "127.0.0.1"}  # where every role of one host runs
ROLE_MODULES = ("lamina.computenode.server", "lamina.memnode.server")  # a role's imports

# Exit status of a role process that found itself re-running its parent's script (see below).
UNGUARDED_MAIN_EXIT = 86
UNGUARDED_MAIN = ("role processes start by re-running your script's top level (Python's "
                  "'forkserver' start method), which creates this LLM again: put the code that "
                  "creates it under `if __name__ == \"__main__\":` (see the README's Python "
                  "example)")


class RoleHandle(Protocol):
    pid: int | None
    where: dict[str, Any]

    def is_alive(self) -> bool: ...

    def join(self, timeout: float | None = None) -> None: ...

    def terminate(self) -> None: ...

    def kill(self) -> None: ...


class Launcher(Protocol):
    here: dict[str, Any]  # where the engine (this process) runs

    def start(self, target: Callable[..., Any], args: tuple, name: str, *, role: str,
              device: str) -> RoleHandle: ...

    def control_link(self, transport: str) -> tuple[str, str]: ...

    def close(self) -> None: ...


class ProcessLauncher:
    """Roles as OS processes on this host, forked from Python's fork server (``forkserver``:
    one clean process, started with the launcher, that imports :data:`ROLE_MODULES` once; safe
    with threads and CUDA in the engine, which never forks itself), so a role skips Python's
    start and torch's import (~1.5 s of a core each on a small machine). A role takes the
    engine's environment as it is when the role starts (:func:`_run_role`). Roles are daemonic,
    so none outlives the engine's process.

    :meth:`keep_spare` starts one process ahead that waits; the next :meth:`start` hands it
    the role instead of starting one (with the fork server that saves only the fork)."""

    here = LOCAL

    def __init__(self) -> None:
        if getattr(multiprocessing.current_process(), "_inheriting", False):
            # We are a role process still being bootstrapped: it is importing the
            # parent's main module, whose top level starts roles again. multiprocessing would
            # raise a riddle here; exit with a status the parent turns into UNGUARDED_MAIN.
            os._exit(UNGUARDED_MAIN_EXIT)
        self.ctx = multiprocessing.get_context("forkserver")
        self.ctx.set_forkserver_preload(list(ROLE_MODULES))
        omp.for_roles()  # the fork server's environment, libgomp's settings in every role
        multiprocessing.forkserver.ensure_running()  # its imports overlap the engine's start
        self._spare: tuple[Any, Any] | None = None  # (process, its end of the pipe)

    def start(self, target: Callable[..., Any], args: tuple, name: str, *, role: str = "",
              device: str = "cpu") -> RoleHandle:
        p = self._take_spare(name, target, args)
        if p is None:
            p = self.ctx.Process(target=_run_role, args=(name, target, args, dict(os.environ)),
                                 name=name, daemon=True)
            p.start()
        p.where = LOCAL
        return p

    def keep_spare(self) -> None:
        """Have a spare role process waiting (start one unless one is)."""
        if self._spare is not None and self._spare[0].is_alive():
            return
        mine, its = self.ctx.Pipe()
        p = self.ctx.Process(target=_spare, args=(its,), name="lamina: spare role", daemon=True)
        p.start()
        its.close()
        self._spare = (p, mine)

    def _take_spare(self, name: str, target: Callable[..., Any], args: tuple) -> Any:
        """The spare, now running ``target(*args)`` as ``name``; None where none is ready (still
        importing, or gone)."""
        spare, self._spare = self._spare, None
        if spare is None:
            return None
        p, pipe = spare
        try:
            if p.is_alive() and pipe.poll() and pipe.recv() == "ready":
                pipe.send((name, target, args, dict(os.environ)))
                p.name = name
                return p
        except (OSError, EOFError):
            pass
        _stop_spare(p, pipe)
        return None

    def control_link(self, transport: str) -> tuple[str, str]:
        if transport == "tcp":
            return "tcp", "127.0.0.1"
        return "shm", "127.0.0.1"

    def close(self) -> None:
        if self._spare is not None:
            _stop_spare(*self._spare)
            self._spare = None


def _spare(pipe) -> None:
    """A spare role process: import what roles import, say so, then run the role it is handed
    (None, or the launcher's end closing: exit)."""
    for module in ROLE_MODULES:  # torch and the rest
        importlib.import_module(module)
    try:
        pipe.send("ready")
        job = pipe.recv()
    except (OSError, EOFError):  # the launcher is gone
        return
    if job is not None:
        pipe.close()
        _run_role(*job)


def _run_role(title: str, target: Callable[..., Any], args: tuple,
              environ: dict[str, str]) -> Any:
    """A role process's entry: its title, the starting process's environment as it is now (a
    forkserver child inherits the fork server's, from when it started), the role, then
    Python's exit handlers, which a forkserver child would skip (it leaves through
    ``os._exit``): they run the finalizers of what the role still holds (a ring it created
    drops its registration with the resource tracker, which would otherwise report it
    leaked). The title comes first: ``setproctitle`` finds the command line's memory by the
    environment the process started with, and after ``os.environ.clear()`` it cannot (the
    title was silently not set)."""
    set_title(title)
    os.environ.clear()
    os.environ.update(environ)
    try:
        return target(*args)
    finally:
        atexit._run_exitfuncs()


def _stop_spare(p, pipe) -> None:
    try:
        pipe.send(None)
    except (OSError, ValueError):
        pass
    pipe.close()
    stop_role(p, timeout=2.0)


def stop_role(p: RoleHandle, timeout: float = 5.0) -> None:
    """Wait for ``p`` to exit, then terminate, then kill: no orphan survives."""
    p.join(timeout)
    if p.is_alive():
        p.terminate()
        p.join(timeout)
    if p.is_alive():
        p.kill()
        p.join(timeout)
