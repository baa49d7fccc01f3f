"""One instance as a :class:`~lamina.deployment.Deployment` sees it: an engine with its memory
pool (:class:`Instance`), and :func:`local_instances`, which builds several in this process over
one split model. Ray-placed instances are built by :func:`lamina.cluster.start_deployment`.
Request and step ids of instance ``i`` start at ``i * ID_STRIDE``, so they never collide on a
memory node that several instances share (borrowing).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from lamina.borrowing import RManager
from lamina.computenode.replica import ComputeReplica
from lamina.computenode.sampling import Sampler
from lamina.engine import Engine
from lamina.nodes import MemoryPoolHandle, start_memory_pool
from lamina.pool import InProcessNode
from lamina.scheduler import SchedulerConfig
from lamina.splitter import SplitModel
from lamina.worker import LocalWorker, ReplicaWorker

ID_STRIDE = 1 << 40  # request/step ids of instance i start at i * ID_STRIDE


@dataclass
class Instance:
    """One engine with its memory pool, as the deployment sees it.

    ``pool`` holds the deployment's own clients of the instance's nodes (EXPORT/IMPORT/FREE of
    ranges when KV moves; STATS) and its closers stop the instance. ``share(k, debtor)`` gives
    what ``debtor``'s worker attaches to reach own node ``k`` (an :class:`InProcessNode` in
    this process; a channel endpoint for a Ray-placed replica). ``host`` is what runs the
    instance (a :class:`lamina.cluster.Cluster` when launched), or None in this process.
    """

    inst_id: int
    engine: Engine
    pool: MemoryPoolHandle
    own_nodes: int
    share: Callable[[int, "Instance"], Any]
    host: Any = None
    rmanager: RManager | None = None
    physical: list[int] = field(default_factory=list)  # own nodes' real capacities
    failed: BaseException | None = None

    def __post_init__(self) -> None:
        if not self.physical:
            self.physical = list(self.pool.capacities)

    @property
    def scheduler(self):
        return self.engine.scheduler

    def load(self) -> int:
        s = self.scheduler
        return len(s.running) + len(s.waiting)


def local_instances(split: SplitModel, instances: int, memory: int, *, kv_cache_tokens: int,
                    slab_size: int, device: str, dtype: torch.dtype, config: SchedulerConfig,
                    eos_token_ids: set[int] | None = None, tokenizer=None) -> list[Instance]:
    """``instances`` engines in this process over one split model (shared weights), each with
    ``memory`` in-process nodes of ``kv_cache_tokens`` slots."""
    out = []
    for i in range(instances):
        pool = start_memory_pool(split.specs, memory, transport="local", device=device,
                                 dtype=dtype, kv_cache_tokens=kv_cache_tokens,
                                 slab_size=slab_size)
        worker = LocalWorker(ReplicaWorker([ComputeReplica(split, device, Sampler())],
                                           pool.clients))
        engine = Engine(worker, pool.capacities, config, eos_token_ids, tokenizer,
                        id_base=i * ID_STRIDE)

        def share(k: int, debtor: Instance, pool=pool, i=i) -> InProcessNode:
            client = pool.clients[k]
            return InProcessNode(client.node, f"instance {i} {client.name}")

        out.append(Instance(i, engine, pool, memory, share))
    return out
