"""Roles out of the engine's process (placements ``procs`` and ``ray``): starting and stopping
them. The servers are :mod:`lamina.memnode.server` and :mod:`lamina.computenode.server`; where
they run is the launcher's business (:mod:`lamina.instance.launcher`); the engine's worker that
drives the replicas is :class:`~lamina.instance.remote_replicas.RemoteReplicas`.

Start-up, written once for both roles (:func:`spawn_roles`): the engine opens a control channel
per role, the launcher starts the role with its endpoint and config, and every role must answer
a PING within ``START_TIMEOUT_S`` (:meth:`Starting.ready`); memory nodes and replicas start side
by side; any failure stops whatever was started. A dead memory node is started again alone
with :func:`restart_node`.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Callable

import torch

from lamina.config import KernelConfig
from lamina.device import Device
from lamina.errors import NodeFailure
from lamina.instance.launcher import (UNGUARDED_MAIN, UNGUARDED_MAIN_EXIT, Launcher, RoleHandle,
                                     stop_role)
from lamina.memnode.server import node_config, serve_node
from lamina.stages import add_role
from lamina.transport import codec
from lamina.transport.base import START_TIMEOUT_S, ChannelClosed, PeerDied
from lamina.transport.endpoint import SPIN_US, listen
from lamina.transport.node_client import RemoteNode
from lamina.types import AttentionSpec

if TYPE_CHECKING:
    from lamina.instance.remote_replicas import RemoteReplicas

@dataclass
class Starting:
    """Roles spawned and not yet known to be up (:func:`spawn_roles`): :meth:`ready` waits for
    each one's PING reply; :meth:`stop` stops every one started (idempotent)."""

    handles: list[RoleHandle]
    channels: list
    started: list[float]
    role: str
    first: int = 0  # the number of the first role (a restarted one keeps its own)

    def ready(self) -> tuple[list[RoleHandle], list]:
        """Wait until each role answers a PING; its handles and the engine's control channels
        to them. On any failure every role started is stopped and the error propagates."""
        label = "memory node" if self.role == "memory" else "replica"
        try:
            for i, ch in enumerate(self.channels):
                try:
                    ch.send(codec.ping())
                    reply = codec.raise_if_error(ch.recv(START_TIMEOUT_S))
                    add_role(f"{label} {self.first + i}", time.perf_counter() - self.started[i],
                             reply.meta.get("stages", {}))
                except (PeerDied, ChannelClosed, TimeoutError) as e:
                    if getattr(self.handles[i], "exitcode", None) == UNGUARDED_MAIN_EXIT:
                        raise RuntimeError(UNGUARDED_MAIN) from None
                    raise NodeFailure(f"{self.role} role {self.first + i} did not start: {e}") from e
        except BaseException:
            self.stop()
            raise
        return self.handles, self.channels

    def stop(self) -> None:
        stop_roles(self.handles, self.channels)


def spawn_roles(launcher: Launcher, target: Callable[..., Any], configs: list[dict], *,
                role: str, device: str, transport: str, first: int = 0) -> Starting:
    """Start one ``role`` (``compute`` or ``memory``) per config, without waiting for them
    (several kinds of role start side by side; :meth:`Starting.ready` waits); the roles are
    numbered from ``first``. On a failure to start one, every role started is stopped and the
    error propagates."""
    starting = Starting([], [], [], role, first)
    label = "memory node" if role == "memory" else "replica"
    try:
        for i, cfg in enumerate(configs, first):
            lst = listen(*launcher.control_link(transport))
            starting.started.append(time.perf_counter())
            starting.handles.append(launcher.start(target, (lst.endpoint, cfg),
                                                   f"lamina: {label} {i}", role=role,
                                                   device=device))
            ch = lst.channel()
            ch.set_peer_alive(starting.handles[-1].is_alive)
            starting.channels.append(ch)
    except BaseException:
        starting.stop()
        raise
    return starting


def stop_roles(handles: list[RoleHandle], channels: list) -> None:
    """SHUTDOWN every role still alive, then stop each (join, terminate, kill)."""
    for ch, h in zip(channels, handles):
        if h.is_alive() and not ch.closed:
            try:
                ch.send(codec.shutdown())
            except Exception:
                pass
    for h in handles:
        stop_role(h)
    for ch in channels:
        ch.close()


def spawn_memory_nodes(launcher: Launcher, specs: list[AttentionSpec], devices: list[Device],
                       capacity: int, *, dtype: torch.dtype, kv_dtype: str = "auto",
                       slab_size: int, transport: str,
                       num_threads: int = 1, spin_us: list[float] | None = None,
                       kernels: KernelConfig | None = None, first: int = 0) -> Starting:
    """Spawn one memory-node server of ``capacity`` slots per device (each pins itself to its
    device's cores and computes with ``kernels``), numbered from ``first``;
    :func:`node_clients` of what :meth:`Starting.ready` returns are the engine's clients."""
    spin_us = spin_us or [SPIN_US] * len(devices)
    configs = [asdict(node_config(specs, capacity, d.torch, dtype, slab_size, num_threads,
                                  list(d.cores) if d.cores else None, sp, kernels, kv_dtype))
               for d, sp in zip(devices, spin_us)]
    return spawn_roles(launcher, serve_node, configs, role="memory", device=devices[0].torch,
                       transport=transport, first=first)


def node_clients(handles: list[RoleHandle], channels: list, first: int = 0) -> list[RemoteNode]:
    """The engine's clients of started memory nodes (``client.process``: the role's handle;
    the caller stops it)."""
    return [RemoteNode(ch, h, f"memory node {i}")
            for i, (h, ch) in enumerate(zip(handles, channels), first)]


def restart_node(spawn: Callable[[int, int], Starting], starting: Starting,
                 worker: "RemoteReplicas", nodes: list[RemoteNode], k: int) -> None:
    """Start memory node ``k`` of an instance again, empty, in place of a dead one: ``spawn(k,
    1)`` starts it as the instance's own start did; once it answers, every replica joins it
    (``worker``), the engine's client in ``nodes`` and the instance's role list (``starting``,
    which its close stops) point at it, and the dead one's handle and channel are released."""
    new = spawn(k, 1)
    handles, channels = new.ready()
    client = node_clients(handles, channels, first=k)[0]
    try:
        worker.replace_node(k, client)
    except BaseException:
        new.stop()
        raise
    old = (starting.handles[k], starting.channels[k])
    starting.handles[k], starting.channels[k] = handles[0], channels[0]
    nodes[k] = client
    stop_roles([old[0]], [old[1]])
