"""The ``ray`` placement's launcher: every role is a Ray actor hosting the same server code
as a ``procs`` process (Ray is the control plane only).

Ray places the actors (custom resources ``lamina_compute`` / ``lamina_memory``, ``num_gpus=1``
on CUDA devices), starts them and reports where they landed; tensors never go through Ray:
each actor runs its role's entry point in a thread and speaks the wire protocol on channels of
its own (shm on one host, tcp across hosts). A local Ray instance is started with those
resources unless one is up; ``address=`` joins an existing cluster whose hosts the operator
tagged, e.g. ``ray start --head --resources '{"lamina_compute": 2, "lamina_memory": 4}'``.
"""
from __future__ import annotations

import logging
import os
import threading
from typing import Any, Callable

import psutil
import ray

from lamina import omp
from lamina.proctitle import keep_title, set_title


def here() -> dict[str, Any]:
    """Where the calling process runs (a driver or an actor): ``{"node_id", "ip"}``."""
    return {"node_id": ray.get_runtime_context().get_node_id(),
            "ip": ray.util.get_node_ip_address()}


@ray.remote(num_cpus=0)
class RoleActor:
    """Hosts one role: ``run(target, args)`` starts ``target(*args)`` in a thread."""

    def __init__(self) -> None:
        self.thread: threading.Thread | None = None

    def run(self, target: Callable[..., Any], args: tuple, title: str) -> dict[str, Any]:
        # the actor's process hosts this role only; Ray sets titles through its own setter
        keep_title(title, setter=getattr(ray._raylet, "setproctitle", set_title))
        self.thread = threading.Thread(target=target, args=args, daemon=True)
        self.thread.start()
        return {**here(), "pid": os.getpid()}

    def alive(self) -> bool:
        return self.thread is not None and self.thread.is_alive()

    def join(self, timeout: float) -> None:
        if self.thread is not None:
            self.thread.join(timeout)


class RayRole:
    """A :class:`~lamina.instance.launcher.RoleHandle` of a role in a Ray actor. Liveness is
    the actor process's pid on this host, else a call to the actor."""

    def __init__(self, actor: Any, info: dict[str, Any], local: bool):
        self.actor = actor
        self.pid = info["pid"]
        self.where = {"node_id": info["node_id"], "ip": info["ip"]}
        self.local = local
        self.exitcode = None
        self._killed = False

    def is_alive(self) -> bool:
        if self._killed:
            return False
        if self.local:
            try:
                return psutil.Process(self.pid).status() != psutil.STATUS_ZOMBIE
            except psutil.Error:
                return False
        try:
            return bool(ray.get(self.actor.alive.remote(), timeout=5.0))
        except Exception:
            return False

    def join(self, timeout: float | None = None) -> None:
        """Wait for the role's thread to end; then the actor process is stopped (an actor
        whose role has ended has nothing left to do)."""
        if self._killed:
            return
        try:
            ray.get(self.actor.join.remote(timeout or 0.0), timeout=(timeout or 0.0) + 5.0)
            if not ray.get(self.actor.alive.remote(), timeout=5.0):
                self.kill()
        except Exception:
            pass

    def terminate(self) -> None:
        self.kill()

    def kill(self) -> None:
        try:
            ray.kill(self.actor)
        except Exception:
            pass
        self._killed = True


class RayLauncher:
    """Roles as Ray actors (see the module docstring). ``transport`` ``auto`` gives shm while
    the cluster has one host and tcp across hosts. :meth:`close` shuts Ray down if this
    launcher started it."""

    def __init__(self, address: str | None = None, resources: dict[str, float] | None = None):
        self.started = ensure_ray(address, resources or {})
        self.here = here()
        self.hosts = len([n for n in ray.nodes() if n.get("Alive")])

    def start(self, target: Callable[..., Any], args: tuple, name: str, *, role: str,
              device: str = "cpu") -> RayRole:
        gpus = 1 if str(device).startswith("cuda") else 0
        actor = RoleActor.options(name=None, num_gpus=gpus,
                                  resources={f"lamina_{role}": 1}).remote()
        info = ray.get(actor.run.remote(target, args, name))
        return RayRole(actor, info, local=info["node_id"] == self.here["node_id"])

    def control_link(self, transport: str) -> tuple[str, str]:
        if transport == "shm" or (transport == "auto" and self.hosts == 1):
            return "shm", "127.0.0.1"
        return "tcp", "127.0.0.1" if self.hosts == 1 else self.here["ip"]

    def close(self) -> None:
        if self.started and ray.is_initialized():
            ray.shutdown()
        self.started = False


def ensure_ray(address: str | None, resources: dict[str, float]) -> bool:
    """Start a local Ray with ``resources`` (or join ``address``) unless Ray is up already;
    True if this call started it (its caller then shuts it down)."""
    if ray.is_initialized():
        return False
    # Ray enables token authentication for a local cluster (good) and says so on the user's
    # terminal at every start; the notice is Ray's, not an action for a Lamina user.
    logging.getLogger("ray._private.authentication.authentication_token_setup").setLevel(
        logging.ERROR)
    if address is None:
        omp.for_roles()  # the local raylet, and so its actor processes, inherit this environment
        ray.init(resources=resources, include_dashboard=False, log_to_driver=False,
                 configure_logging=False)
    else:
        ray.init(address=address, log_to_driver=False, configure_logging=False)
    return True
