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

from lamina.remote_worker import RemoteWorker

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
    """One memory node: a MemoryNode served on one channel per client (its own compute
    replica, debtor replicas that borrowed from it, the deployment moving KV), one request at
    a time across all of them."""

    def __init__(self, config: dict):
        from lamina.remote import build_node
        torch.set_num_threads(int(config.get("num_threads", 1)))
        self.node = build_node(config)
        self.lock = threading.Lock()

    def where(self) -> dict:
        return _here()

    def open(self, transport: str, bind_host: str) -> dict:
        from lamina.remote import serve_channel
        return _serve_endpoint(transport, bind_host,
                               lambda ch: serve_channel(self.node, ch, self.lock))

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

    def attach(self, endpoint: dict, name: str) -> int:
        """Connect to another pool's memory node (borrowing); its index in routes. Called by
        the engine between its steps (no step of this replica in flight)."""
        from lamina.remote import RemoteNode
        return self.worker.attach(RemoteNode(open_channel(endpoint), None, name))

    def profile(self) -> dict:
        """The borrowing performance model measured on this replica's device."""
        from dataclasses import asdict

        from lamina.profiling import profile_perf
        return asdict(profile_perf(self.replica.split, str(self.replica.device),
                                   self.loaded.dtype))

    def ping(self) -> bool:
        return True


class ClusterWorker(RemoteWorker):
    """The engine's client of a Ray-placed replica: the data plane over its channel, plus
    ``attach`` of a borrowed node's endpoint through the actor."""

    def __init__(self, channel, actor, name: str = "compute replica 0"):
        super().__init__(channel, name)
        self.actor = actor

    def attach(self, endpoint: dict) -> int:
        return ray.get(self.actor.attach.remote(endpoint, f"borrowed {endpoint['name']}"))


@dataclass
class Cluster:
    """The actors of one instance and the engine-side channel to its compute replica."""

    replica: Any
    memory: list[Any]
    info: dict
    capacities: list[int]
    worker: ClusterWorker
    transports: dict[str, str] = field(default_factory=dict)
    started_ray: bool = False
    transport: str = "auto"
    where: dict = field(default_factory=dict)  # the replica's placement
    node_where: list[dict] = field(default_factory=list)

    def healthy(self, timeout: float = 5.0) -> bool:
        try:
            ray.get([a.ping.remote() for a in [self.replica, *self.memory]], timeout=timeout)
            return True
        except Exception:
            return False

    def share(self, k: int, debtor: "Cluster", name: str = "") -> dict:
        """An endpoint of memory node ``k`` for ``debtor``'s replica (a new channel)."""
        kind, host = _pick(self.transport, self.node_where[k], debtor.where)
        return {**ray.get(self.memory[k].open.remote(kind, host)), "name": name or f"memory node {k}"}

    def node_clients(self, prefix: str = "") -> list:
        """Clients of every memory node from this process, each on a channel of its own."""
        from lamina.remote import RemoteNode
        here = _here()
        out = []
        for k, (actor, w) in enumerate(zip(self.memory, self.node_where)):
            kind, host = _pick(self.transport, w, here)
            out.append(RemoteNode(open_channel(ray.get(actor.open.remote(kind, host))), None,
                                  f"{prefix}memory node {k}"))
        return out

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


def ensure_ray(address: str | None, resources: dict[str, float],
               progress: Callable[[str], None] = lambda s: None) -> bool:
    """Start a local Ray with ``resources`` (or join ``address``) unless Ray is up already;
    True if this call started it (its caller then shuts it down)."""
    if ray.is_initialized():
        return False
    progress("starting Ray" if address is None else f"joining Ray at {address}")
    if address is None:
        ray.init(resources=resources, include_dashboard=False, log_to_driver=False,
                 configure_logging=False)
    else:
        ray.init(address=address, log_to_driver=False, configure_logging=False)
    return True


def start_cluster(model: str, *, compute: int = 1, memory: int = 1, transport: str = "auto",
                  address: str | None = None, device: str = "cpu",
                  memory_device: str | None = None, dtype: str | None = None,
                  kv_cache_gb: float = 1.0, kv_cache_tokens: int | None = None,
                  slab_size: int = 256, progress: Callable[[str], None] = lambda s: None) -> Cluster:
    """Start (or join) Ray, place and connect one instance's actors; see the module docstring."""
    from lamina.nodes import node_capacity
    from lamina.remote import node_config
    from lamina.types import AttentionSpec

    if transport not in TRANSPORTS:
        raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
    if compute != 1:
        raise ValueError("lamina launch runs one compute replica per instance with one "
                         "micro-batch; several replicas with staggered pipelining (--compute N, "
                         "--micro-batches n, --compute-processes) run on one host through "
                         "lamina generate, lamina bench or LLM(...)")
    started = ensure_ray(address, {"lamina_compute": compute, "lamina_memory": memory}, progress)
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
        worker = ClusterWorker(open_channel(ray.get(replica.open.remote(kind, host))), replica)
        worker.stats()  # round trip through replica and every memory node
        return Cluster(replica, nodes, info, [cap] * memory, worker,
                       {"engine-replica": kind, "replica-memory": ",".join(k for k, _ in links)},
                       started, transport, r_where, n_where)
    except BaseException:
        for a in actors:
            ray.kill(a)
        if started:
            ray.shutdown()
        raise


def start_deployment(model: str, *, instances: int = 1, compute: int = 1, memory: int = 1,
                     transport: str = "auto", address: str | None = None, device: str = "cpu",
                     memory_device: str | None = None, dtype: str | None = None,
                     kv_cache_gb: float = 1.0, kv_cache_tokens: int | None = None,
                     slab_size: int = 64, borrowing: bool = True, plan_every: int = 0,
                     beta_thres: int = 8, util_thres: float = 0.5, perf="profile",
                     max_num_seqs: int = 64,
                     max_num_batched_tokens: int = 512, tokenizer=None,
                     progress: Callable[[str], None] = lambda s: None):
    """``instances`` Ray-placed instances (each: :func:`start_cluster`) behind one
    :class:`~lamina.deployment.Deployment` in this process: its router, engines, rManagers,
    and a gManager actor when ``borrowing`` (with more than one instance). With
    ``plan_every`` the greedy placement runs on ``perf`` (a PerfModel, or ``"profile"``:
    measured on the first replica now). Closing the deployment stops every actor (and Ray, if this call started it)."""
    from lamina.borrowing import PerfModel
    from lamina.deployment import Deployment
    from lamina.instance import ID_STRIDE, Instance
    from lamina.engine import Engine
    from lamina.nodes import MemoryPoolHandle
    from lamina.scheduler import SchedulerConfig

    if instances < 1:
        raise ValueError(f"instances must be >= 1, got {instances}")
    started = ensure_ray(address, {"lamina_compute": compute * instances,
                                   "lamina_memory": memory * instances}, progress)
    clusters: list[Cluster] = []
    try:
        for i in range(instances):
            clusters.append(start_cluster(
                model, compute=compute, memory=memory, transport=transport, device=device,
                memory_device=memory_device, dtype=dtype, kv_cache_gb=kv_cache_gb,
                kv_cache_tokens=kv_cache_tokens, slab_size=slab_size,
                progress=(lambda s, i=i: progress(f"instance {i}: {s}")) if instances > 1
                else progress))
        clusters[0].started_ray = started  # closed last (Deployment.close goes in reverse)
        insts = []
        for i, c in enumerate(clusters):
            info = c.info
            config = SchedulerConfig(max_num_seqs, max_num_batched_tokens, info["max_model_len"])
            engine = Engine(c.worker, c.capacities, config, set(info["eos"]), tokenizer,
                            info["vocab_size"], id_base=i * ID_STRIDE)
            clients = c.node_clients(f"instance {i} ")
            pool = MemoryPoolHandle(clients, list(c.capacities),
                                    [c.shutdown, *(cl.close for cl in clients)])

            def share(k: int, debtor, c=c, i=i) -> dict:
                return c.share(k, debtor.host, f"instance {i} memory node {k}")

            insts.append(Instance(i, engine, pool, memory, share, host=c))
        borrowing = borrowing and instances > 1
        if not (borrowing and plan_every):
            perf = None
        elif perf == "profile":
            progress("profiling the performance model")
            perf = PerfModel(**ray.get(clusters[0].replica.profile.remote()))
        return Deployment(insts, slab_size=slab_size, borrowing=borrowing, gmanager="ray",
                          beta_thres=beta_thres, util_thres=util_thres, perf=perf,
                          plan_every=plan_every)
    except BaseException:
        for c in reversed(clusters):
            c.shutdown()
        if started and ray.is_initialized():
            ray.shutdown()
        raise
