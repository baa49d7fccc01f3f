"""Starting and stopping the memory nodes of one instance.

``start_memory_pool`` sizes each node's KV pool and starts the nodes: in this process for the
``local`` transport, or as separate OS processes through a :class:`~lamina.launcher.Launcher`
for ``shm`` (the Ray launcher arrives with ``lamina launch``). The returned handle owns them.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from lamina.memnode import KVPool, MemoryNode
from lamina.pool import InProcessNode, NodeClient
from lamina.types import AttentionSpec

TRANSPORTS = ("local", "shm")


@dataclass
class MemoryPoolHandle:
    clients: list[NodeClient]
    capacities: list[int]
    closers: list[Callable[[], None]] = field(default_factory=list)
    closed: bool = False

    def close(self) -> None:
        self.closed = True
        while self.closers:
            self.closers.pop()()


def node_capacity(specs: list[AttentionSpec], dtype: torch.dtype, kv_cache_gb: float,
                  kv_cache_tokens: int | None) -> int:
    if kv_cache_tokens is not None:
        if kv_cache_tokens < 1:
            raise ValueError(f"kv_cache_tokens must be >= 1, got {kv_cache_tokens}")
        return int(kv_cache_tokens)
    s = specs[0]
    cap = KVPool.capacity_for_bytes(int(kv_cache_gb * (1 << 30)), len(specs), s.num_kv_heads,
                                    s.head_dim, dtype)
    if cap < 1:
        raise ValueError(f"kv_cache_gb={kv_cache_gb} holds no token of this model")
    return cap


def start_memory_pool(specs: list[AttentionSpec], memory: int, *, transport: str = "local",
                      device: str = "cpu", dtype: torch.dtype = torch.float32,
                      kv_cache_gb: float = 1.0, kv_cache_tokens: int | None = None,
                      slab_size: int = 256, launcher=None) -> MemoryPoolHandle:
    if transport not in TRANSPORTS:
        raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
    cap = node_capacity(specs, dtype, kv_cache_gb, kv_cache_tokens)
    if transport == "local":
        clients = [InProcessNode(MemoryNode(specs, cap, slab_size=slab_size, dtype=dtype,
                                            device=device), name=f"memory node {i}")
                   for i in range(memory)]
        return MemoryPoolHandle(clients, [cap] * memory)
    from lamina.remote import start_remote_nodes
    return start_remote_nodes(specs, memory, cap, device=device, dtype=dtype,
                              slab_size=slab_size, launcher=launcher)
