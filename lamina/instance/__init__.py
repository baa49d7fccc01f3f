"""One instance type, placed three ways.

An instance is one engine (scheduler) + ``C`` compute replicas + ``M`` memory nodes. The
memory-node server and the compute-replica server are the same code under every placement; the
placement only decides where each role runs and which channel connects them:

* ``inproc``: both in the engine's process (``InProcessNode`` +
  :class:`~lamina.instance.inproc.InProcessReplicas`; local calls, no copy; the replicas share
  the weights);
* ``procs``: each role an OS process on this host (:class:`~lamina.instance.launcher.ProcessLauncher`);
* ``ray``: each role a Ray actor (:class:`~lamina.instance.ray_actors.RayLauncher`).

Out of process, the engine talks to the replicas through :class:`~lamina.instance.remote_replicas.RemoteReplicas`
and to the nodes through :class:`~lamina.transport.node_client.RemoteNode` (FREE, STATS, KV
moves); memory nodes reply to the replica that runs the next slice. Request and step ids of
instance ``i`` start at ``i * ID_STRIDE`` and its replicas are peers ``i * PEER_STRIDE + r`` on
memory nodes, so instances that share a node (borrowing) never collide.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from functools import partial
from typing import Any, Callable

import torch

from lamina.computenode.polling import make_polling
from lamina.computenode.gguf_linear import blocks_for
from lamina.computenode.replica import ComputeReplica
from lamina.computenode.sampling import Sampler
from lamina.computenode.replica_config import ReplicaConfig
from lamina.config import CacheConfig, DeploymentConfig, dtype_name
from lamina.device import Device, exclusive, own_cores, parse
from lamina.engine.engine import ID_STRIDE, Engine
from lamina.instance.inproc import InProcessReplicas
from lamina.instance.launcher import Launcher
from lamina.kernels.kv_format import kv_format
from lamina.memnode import KVPool, MemoryNode
from lamina.memnode.native import plane_for
from lamina.models import default_dtype, eos_token_ids, load_model
from lamina.split_cache import cached_layout, cached_record, load_split, store_record
from lamina.stages import stage
from lamina.splitter import SplitModel
from lamina.timeline import Timeline
from lamina.transport.endpoint import SPIN_US
from lamina.transport.node_client import InProcessNode, NodeClient
from lamina.types import AttentionSpec

PEER_STRIDE = 1 << 16  # replica r of instance i is peer i * PEER_STRIDE + r on memory nodes


@dataclass
class ModelInfo:
    """What the engine side knows of the model, whatever the placement: the attention specs
    (they size the KV pools), the number of slices, tokenizer, stop ids and limits, and the
    split itself, which only in-process replicas (and the performance profile) run: read on
    first use (:attr:`split`) where the split cache already told the specs, so an engine whose
    replicas are processes never reads it."""

    specs: list[AttentionSpec]
    num_slices: int
    dtype: torch.dtype
    tokenizer: Any
    eos: set[int]
    vocab_size: int | None
    max_model_len: int | None
    read_split: Callable[[], SplitModel]  # how to get the split (called once, at most)
    _split: SplitModel | None = None  # the split once read

    @property
    def split(self) -> SplitModel:
        if self._split is None:
            self._split = self.read_split()
        return self._split


_LAST_INFO: dict[tuple, ModelInfo] = {}  # the last model split in this process (one entry)


def load_model_info(config: DeploymentConfig) -> ModelInfo:
    """Load and split the model once, on the compute device. A process that starts several
    instances of one model in a row (a benchmark's setups, a test module) splits it once: the
    last split is kept, keyed by the model's name, dtype, device and linear kernel choice (an
    in-process replica rewrites its slices' linear nodes for that choice, in place)."""
    device = parse(config.instance.device).torch
    key = (str(config.model.model), config.model.torch_dtype, str(device),
           config.instance.kernels.linear)
    if key not in _LAST_INFO:
        _LAST_INFO.clear()  # at most one model held beyond its instances' lives
        _LAST_INFO[key] = _load_model_info(config.model.model, config.model.torch_dtype, device)
    return _LAST_INFO[key]


def _load_model_info(model: str, dtype: torch.dtype | None, device: torch.device) -> ModelInfo:
    """From the split cache alone where it holds the split and the engine's record of the model
    (no model load, no split read); else load the model, split it if needed, and keep the
    record for the next engine."""
    dtype = dtype or default_dtype(device)

    def read_split() -> SplitModel:  # holds no model: a cache miss loads it again
        return load_split(model, dtype, device,
                          lambda: load_model(model, dtype=dtype, device=device).model)
    layout = cached_layout(model, dtype, device)
    cached = cached_record(model, dtype, device) if layout is not None else None
    if cached is not None:
        (r, tokenizer) = cached
        return ModelInfo(*layout, dtype, tokenizer, set(r["eos"]), r["vocab_size"],
                         r["max_model_len"], read_split)
    with stage("load model"):
        loaded = load_model(model, dtype=dtype, device=device)
    cfg = getattr(loaded.model, "config", None)
    split = None
    if layout is None:  # no cached split: split now (and store it for the role processes)
        split = load_split(model, dtype, device, lambda: loaded.model)
        layout = (split.specs, len(split.slices))
    record = {"eos": sorted(eos_token_ids(loaded.model, loaded.tokenizer)),
              "vocab_size": getattr(cfg, "vocab_size", None),
              "max_model_len": getattr(cfg, "max_position_embeddings", None)}
    store_record(model, dtype, device, record, loaded.tokenizer)
    return ModelInfo(*layout, dtype, loaded.tokenizer, set(record["eos"]), record["vocab_size"],
                     record["max_model_len"], read_split, split)


def node_capacity(specs: list[AttentionSpec], dtype: torch.dtype, cache: CacheConfig) -> int:
    """KV slots per memory node: ``kv_cache_tokens``, else what ``kv_cache_gb`` holds in the
    KV format ``cache.kv_dtype`` (of a ``dtype`` model)."""
    if cache.kv_cache_tokens is not None:
        return int(cache.kv_cache_tokens)
    s = specs[0]
    cap = KVPool.capacity_for_bytes(int(cache.kv_cache_gb * (1 << 30)), len(specs),
                                    s.num_kv_heads, s.head_dim, kv_format(cache.kv_dtype, dtype))
    if cap < 1:
        raise ValueError(f"kv_cache_gb={cache.kv_cache_gb} holds no token of this model")
    return cap


@dataclass
class Instance:
    """One engine with its replicas and memory pool, as the deployment sees it. ``nodes`` are
    the engine-side clients of the instance's own nodes (FREE, STATS, EXPORT/IMPORT when KV
    moves); ``closers`` stop its roles (replicas first); ``physical`` are the own nodes' real
    capacities (the scheduler's change as slots are lent)."""

    inst_id: int
    engine: Engine
    nodes: list[NodeClient]
    closers: list[Callable[[], None]] = field(default_factory=list)
    physical: list[int] = field(default_factory=list)
    rmanager: Any = None  # a lamina.deployment.borrowing.RManager, with borrowing
    failed: BaseException | None = None
    retry_at: float = 0.0  # when failed: the monotonic time of the next restart attempt
    restart_node: Callable[[int], None] | None = None  # start own node k again, empty (procs, ray)

    @property
    def scheduler(self):
        return self.engine.scheduler

    @property
    def own_nodes(self) -> int:
        return len(self.nodes)

    def dead_nodes(self) -> list[int]:
        """Own nodes whose process (or actor) is gone."""
        return [k for k, n in enumerate(self.nodes)
                if getattr(n, "process", None) is not None and not n.process.is_alive()]

    def load(self) -> int:
        s = self.scheduler
        return len(s.running) + len(s.waiting)

    def share(self, k: int) -> NodeClient:
        """A client of own node ``k`` for another instance's replicas (borrowing): a new
        in-process handle, or this engine's client of a remote node, through which the
        debtor's replicas open peer channels of their own."""
        client = self.nodes[k]
        if isinstance(client, InProcessNode):
            return InProcessNode(client.node, f"instance {self.inst_id} {client.name}")
        return client

    def close(self) -> None:
        """Stop every role of the instance (replicas, then nodes). Safe to call twice."""
        while self.closers:
            try:
                self.closers.pop(0)()
            except Exception:
                pass


def start_instance(config: DeploymentConfig, inst_id: int, info: ModelInfo,
                   launcher: Launcher | None, timeline: Timeline | None = None) -> Instance:
    """Start instance ``inst_id`` of ``config`` (its roles placed by ``launcher``; None for
    ``inproc``) and return it; on failure nothing it started is left running."""
    icfg = config.instance
    cap = node_capacity(info.specs, info.dtype, config.cache)
    replica_devs, node_devs = icfg.role_devices()
    # graphs and polling together: whole decode steps (step_graphs), no per-slice graphs
    whole_steps = icfg.cuda_graphs and icfg.device_polling != "off"
    graph_tokens = config.scheduler.max_num_seqs if icfg.cuda_graphs and not whole_steps else 0
    if icfg.device_polling == "cuda":  # refused before any role starts
        from lamina.computenode.polling import unavailable
        if (why := unavailable(replica_devs[0].torch)) is not None:
            raise ValueError(why)
    if icfg.placement == "inproc":
        cores = sorted({c for d in replica_devs + node_devs for c in (d.cores or ())})
        if cores:  # cores named: this process runs every role, so it owns their union
            own_cores(cores)
        sampler = Sampler()
        split = info.split  # read here (timed as the split's own stage) when not yet read
        with stage("compute replicas"):  # first: packing is not slowed by the pools' commit
            blocks = blocks_for(config.model.model, replica_devs[0].torch)
            replicas = [ComputeReplica(split, d.torch, sampler, graph_tokens, blocks)
                        for d in replica_devs]
        with stage("memory nodes"):
            nodes: list[NodeClient] = []
            for k, d in enumerate(node_devs):
                node = MemoryNode(info.specs, cap, slab_size=config.cache.slab_size,
                                  dtype=info.dtype, kv_dtype=config.cache.kv_dtype, device=d.torch)
                node.plane = plane_for(node)  # its ATTENDs in one C++ call where it applies
                nodes.append(InProcessNode(node, name=f"memory node {k}"))
        # whole steps: no slice waits on a flag outside a graph (a prefill runs slice by slice)
        polling = None if whole_steps else make_polling(
            icfg.device_polling, replica_devs[0].torch, icfg.pipeline.micro_batches,
            config.scheduler.max_num_batched_tokens)
        steps, serve, close_steps = {}, None, None
        if whole_steps:
            from lamina.computenode.step_graphs import device_steps
            with stage("step graphs"):
                steps, serve, close_steps = device_steps(
                    icfg.device_polling, split, [d.torch for d in replica_devs],
                    [n.node.attend for n in nodes], icfg.pipeline.micro_batches,
                    config.scheduler.max_num_seqs, info.dtype)
        worker = InProcessReplicas(replicas, nodes, icfg.pipeline, timeline, polling, steps, serve)
        closers: list[Callable[[], None]] = [worker.close]
        if close_steps is not None:
            closers.append(close_steps)
        restart = None  # the nodes live and die with this process
    else:
        from lamina.instance.procs import (node_clients, restart_node, spawn_memory_nodes,
                                           stop_roles)
        from lamina.instance.remote_replicas import RemoteReplicas
        spin, idle_spin = receiver_spin(replica_devs, node_devs,
                                        config.instances == 1 and icfg.spin)
        node_spin = spin[len(replica_devs):]

        def spawn_nodes(first: int = 0, count: int = icfg.memory):  # all, or one to restart
            return spawn_memory_nodes(launcher, info.specs, node_devs[first:first + count], cap,
                                      dtype=info.dtype, kv_dtype=config.cache.kv_dtype,
                                      slab_size=config.cache.slab_size,
                                      transport=icfg.transport, num_threads=icfg.num_threads,
                                      spin_us=node_spin[first:first + count],
                                      kernels=icfg.kernels, first=first)
        starting = spawn_nodes()
        nodes: list = []

        def nodes_ready() -> list:  # called by RemoteReplicas once its replicas are spawned
            nodes.extend(node_clients(*starting.ready()))
            return nodes
        template = ReplicaConfig(config.model.model, replica_devs[0].torch,
                                 dtype_name(info.dtype), 0, 1, "none",
                                 num_threads=icfg.num_threads, peer_base=inst_id * PEER_STRIDE,
                                 cuda_graph_tokens=graph_tokens, device_polling=icfg.device_polling,
                                 micro_batches=icfg.pipeline.micro_batches,
                                 max_step_tokens=config.scheduler.max_num_batched_tokens,
                                 kernels=asdict(icfg.kernels),
                                 step_graph_tokens=(config.scheduler.max_num_seqs if whole_steps
                                                    else 0))
        try:
            with stage("roles"):  # nodes and replicas start side by side
                worker = RemoteReplicas(launcher, template, nodes_ready, icfg.pipeline,
                                        replica_devs, num_slices=info.num_slices,
                                        transport=icfg.transport, timeline=timeline,
                                        spin_us=spin[:len(replica_devs)],
                                        idle_spin_us=idle_spin)
        except BaseException:
            starting.stop()
            raise
        # replicas stop before the nodes
        closers = [worker.close, lambda: stop_roles(starting.handles, starting.channels)]
        restart = partial(restart_node, spawn_nodes, starting, worker, nodes)
    scheduler = config.scheduler
    if scheduler.max_model_len is None:
        scheduler = type(scheduler)(scheduler.max_num_seqs, scheduler.max_num_batched_tokens,
                                    info.max_model_len)
    engine = Engine(worker, [cap] * icfg.memory, scheduler, info.eos, info.tokenizer,
                    info.vocab_size, id_base=inst_id * ID_STRIDE,
                    micro_batches=icfg.pipeline.micro_batches,
                    prefix_caching=config.cache.prefix_caching, adapt=icfg.pipeline.adapt)
    return Instance(inst_id, engine, nodes, closers, [cap] * icfg.memory, restart_node=restart)


def receiver_spin(replica_devs: list[Device], node_devs: list[Device], own_core_spin: bool
                  ) -> tuple[list[float], list[float]]:
    """How long each role's receivers busy-poll before sleeping on a doorbell: ``(links,
    idle)``. ``links``: the ``spin_us`` of each role's links (replicas, then nodes): a memory
    node alone on its cores polls for good (``inf``, with ``own_core_spin``: one instance per
    host, ``spin`` set); a role that shares its pinned cores with another never polls (``0``:
    the poll would take the core the other role needs to answer); the rest poll briefly
    (:data:`SPIN_US`). A replica's reader threads never poll for good: their cores run the
    slices. ``idle``: per replica, how long its main thread polls its node rings when it has
    nothing to run: for good where it is alone on its cores (with ``own_core_spin``), else as
    its links."""
    devs = replica_devs + node_devs
    links, idle = [], []
    for i, (d, alone) in enumerate(zip(devs, exclusive(devs))):
        forever = alone and own_core_spin
        if alone:
            links.append(float("inf") if forever and i >= len(replica_devs) else SPIN_US)
        else:
            links.append(0.0 if d.cores else SPIN_US)
        if i < len(replica_devs):
            idle.append(float("inf") if forever else links[-1])
    return links, idle


def launcher_for(config: DeploymentConfig) -> Launcher | None:
    """The launcher of ``config``'s placement (None for ``inproc``). A Ray launcher starts (or
    joins) Ray with the custom resources every instance's roles ask for."""
    icfg = config.instance
    if icfg.placement == "inproc":
        return None
    if icfg.placement == "procs":
        from lamina.instance.launcher import ProcessLauncher
        return ProcessLauncher()
    from lamina.instance.ray_actors import RayLauncher
    return RayLauncher(icfg.address, {"lamina_compute": icfg.compute * config.instances,
                                      "lamina_memory": icfg.memory * config.instances})
