"""Ray as the control plane (DESIGN.md §5): it places the compute replica and the memory nodes
as actors, starts them, exchanges their endpoint addresses and watches their health. Tensors
never go through Ray: every actor serves the wire protocol on a channel of its own (shm when
both ends share a host, tcp otherwise), in a thread beside Ray's method calls.

Placement: actors ask for the custom resources ``lamina_compute`` / ``lamina_memory`` (one
each) and ``num_gpus=1`` on CUDA. A local Ray instance is started with those resources by
default; ``address=`` joins an existing cluster whose hosts were tagged by the operator, e.g.
``ray start --head --resources '{"lamina_compute": 1, "lamina_memory": 4}'``.
"""
from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

import ray
import torch

TRANSPORTS = ("auto", "shm", "tcp")
SHM_RING_BYTES = 8 << 20


def _here() -> dict[str, Any]:
    ctx = ray.get_runtime_context()
    return {"pid": os.getpid(), "node_id": ctx.get_node_id(), "ip": ray.util.get_node_ip_address()}


def _serve_endpoint(transport: str, bind_host: str, serve: Callable[[Any], None]) -> dict:
    """Open the server side of a channel and serve it in a thread; returns the endpoint."""
    if transport == "shm":
        from lamina.transport.shm import ShmChannel
        ch = ShmChannel.create(capacity=SHM_RING_BYTES)
        threading.Thread(target=serve, args=(ch,), daemon=True).start()
        return {"kind": "shm", "spec": ch.spec.to_dict()}
    from lamina.transport.tcp import TcpListener
    listener = TcpListener(bind_host, 0)

    def accept_and_serve() -> None:
        try:
            ch = listener.accept(timeout=600)
        finally:
            listener.close()
        serve(ch)

    threading.Thread(target=accept_and_serve, daemon=True).start()
    host, port = listener.address
    return {"kind": "tcp", "host": host, "port": port}


def open_channel(endpoint: dict):
    """The client side of a channel described by an endpoint from ``_serve_endpoint``."""
    if endpoint["kind"] == "shm":
        from lamina.transport.shm import ShmChannel, ShmChannelSpec
        return ShmChannel.attach(ShmChannelSpec.from_dict(endpoint["spec"]))
    from lamina.transport.tcp import TcpChannel
    return TcpChannel.connect(endpoint["host"], endpoint["port"])


@ray.remote(num_cpus=0)
class MemoryNodeActor:
    """One memory node: a MemoryNode served on one channel (to the compute replica)."""

    def __init__(self, config: dict):
        from lamina.remote import build_node
        torch.set_num_threads(int(config.get("num_threads", 1)))
        self.node = build_node(config)

    def where(self) -> dict:
        return _here()

    def open(self, transport: str, bind_host: str) -> dict:
        from lamina.remote import serve_channel
        return _serve_endpoint(transport, bind_host, lambda ch: serve_channel(self.node, ch))

    def ping(self) -> bool:
        return True


@ray.remote(num_cpus=0)
class ReplicaActor:
    """One compute replica: loads and splits the model, connects to the memory nodes, and
    serves the engine's STEP messages on one channel."""

    def __init__(self, model: str, device: str, dtype: str | None):
        from lamina.computenode.replica import ComputeReplica
        from lamina.models import load_model
        from lamina.splitter import split_model
        loaded = load_model(model, dtype=getattr(torch, dtype) if dtype else None, device=device)
        self.loaded = loaded
        self.replica = ComputeReplica(split_model(loaded.model), device)
        self.worker = None

    def where(self) -> dict:
        return _here()

    def info(self) -> dict:
        from dataclasses import asdict

        from lamina.api import _eos_ids
        cfg = getattr(self.loaded.model, "config", None)
        return {"specs": [asdict(s) for s in self.replica.split.specs],
                "dtype": str(self.loaded.dtype).removeprefix("torch."),
                "eos": sorted(_eos_ids(self.loaded.model, self.loaded.tokenizer)),
                "vocab_size": getattr(cfg, "vocab_size", None),
                "max_model_len": getattr(cfg, "max_position_embeddings", None)}

    def connect(self, endpoints: list[dict]) -> None:
        from lamina.remote import RemoteNode
        from lamina.worker import ReplicaWorker
        nodes = [RemoteNode(open_channel(ep), None, f"memory node {i}")
                 for i, ep in enumerate(endpoints)]
        self.worker = ReplicaWorker(self.replica, nodes)

    def open(self, transport: str, bind_host: str) -> dict:
        from lamina.remote_worker import serve_worker
        return _serve_endpoint(transport, bind_host, lambda ch: serve_worker(self.worker, ch))

    def ping(self) -> bool:
        return True


@dataclass
class Cluster:
    """The actors of one instance and the engine-side channel to its compute replica."""

    replica: Any
    memory: list[Any]
    info: dict
    capacities: list[int]
    worker: Any  # RemoteWorker
    transports: dict[str, str] = field(default_factory=dict)
    started_ray: bool = False

    def healthy(self, timeout: float = 5.0) -> bool:
        try:
            ray.get([a.ping.remote() for a in [self.replica, *self.memory]], timeout=timeout)
            return True
        except Exception:
            return False

    def shutdown(self) -> None:
        """Stop the actors (and Ray, when we started it): nothing is left behind."""
        try:
            self.worker.close()
        except Exception:
            pass
        for a in [self.replica, *self.memory]:
            try:
                ray.kill(a)
            except Exception:
                pass
        if self.started_ray and ray.is_initialized():
            ray.shutdown()


def _pick(transport: str, a: dict, b: dict) -> tuple[str, str]:
    """(backend, bind host) for a link between placements ``a`` (server) and ``b`` (client)."""
    same = a["node_id"] == b["node_id"]
    if transport == "shm" and not same:
        raise ValueError("transport 'shm' needs both ends on one host; use 'auto' or 'tcp'")
    kind = "shm" if transport == "auto" and same else ("tcp" if transport != "shm" else "shm")
    return kind, "127.0.0.1" if same else a["ip"]


def start_cluster(model: str, *, compute: int = 1, memory: int = 1, transport: str = "auto",
                  address: str | None = None, device: str = "cpu",
                  memory_device: str | None = None, dtype: str | None = None,
                  kv_cache_gb: float = 1.0, kv_cache_tokens: int | None = None,
                  slab_size: int = 256, progress: Callable[[str], None] = lambda s: None) -> Cluster:
    """Start (or join) Ray, place and connect the actors; see the module docstring."""
    from lamina.nodes import node_capacity
    from lamina.remote import node_config
    from lamina.remote_worker import RemoteWorker
    from lamina.types import AttentionSpec

    if transport not in TRANSPORTS:
        raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
    if compute != 1:
        raise ValueError("lamina launch runs one compute replica with one micro-batch; several "
                         "replicas and staggered pipelining (--compute N, --micro-batches n) run "
                         "in one process for now: lamina generate, lamina bench or LLM(...)")
    started = False
    if not ray.is_initialized():
        progress("starting Ray" if address is None else f"joining Ray at {address}")
        if address is None:
            ray.init(resources={"lamina_compute": compute, "lamina_memory": memory},
                     include_dashboard=False, log_to_driver=False, configure_logging=False)
        else:
            ray.init(address=address, log_to_driver=False, configure_logging=False)
        started = True
    actors: list[Any] = []
    try:
        gpu = 1 if str(device).startswith("cuda") else 0
        progress("loading and splitting the model on the compute replica")
        replica = ReplicaActor.options(num_gpus=gpu, resources={"lamina_compute": 1}).remote(
            model, device, dtype)
        actors.append(replica)
        info = ray.get(replica.info.remote())
        specs = [AttentionSpec(**s) for s in info["specs"]]
        cap = node_capacity(specs, getattr(torch, info["dtype"]), kv_cache_gb, kv_cache_tokens)
        mdev = memory_device or device
        progress(f"starting {memory} memory node(s) of {cap} KV slots each")
        config = node_config(specs, cap, mdev, getattr(torch, info["dtype"]), slab_size)
        mgpu = 1 if str(mdev).startswith("cuda") else 0
        nodes = [MemoryNodeActor.options(num_gpus=mgpu, resources={"lamina_memory": 1}).remote(config)
                 for _ in range(memory)]
        actors.extend(nodes)
        here = _here()
        r_where = ray.get(replica.where.remote())
        n_where = ray.get([n.where.remote() for n in nodes])
        progress("connecting the data plane")
        links = [_pick(transport, w, r_where) for w in n_where]
        endpoints = ray.get([n.open.remote(kind, host) for n, (kind, host) in zip(nodes, links)])
        ray.get(replica.connect.remote(endpoints))
        kind, host = _pick(transport, r_where, here)
        worker = RemoteWorker(open_channel(ray.get(replica.open.remote(kind, host))))
        worker.stats()  # round trip through replica and every memory node
        return Cluster(replica, nodes, info, [cap] * memory, worker,
                       {"engine-replica": kind, "replica-memory": ",".join(k for k, _ in links)},
                       started)
    except BaseException:
        for a in actors:
            ray.kill(a)
        if started:
            ray.shutdown()
        raise
