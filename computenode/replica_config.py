"""What a compute replica's process or actor is started with: :class:`ReplicaConfig`, plain data
sent at spawn (:mod:`lamina.instance.remote_replicas` fills it from the instance's config;
:func:`lamina.computenode.server.serve_replica` reads it)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from lamina.transport.endpoint import SPIN_US

__all__ = ["ReplicaConfig"]


@dataclass
class ReplicaConfig:
    """What a replica process needs besides its channels (plain data, sent at spawn)."""

    model: str
    device: str
    dtype: str | None
    index: int
    replicas: int
    schedule: str
    attn_parts: int = 1
    num_threads: int = 1
    trace: bool = False  # record timeline spans and send them with TOKENS
    peer_base: int = 0  # this instance's replica i is peer ``peer_base + i`` on memory nodes
    cores: list[int] | None = None  # CPU cores owned: pinned, one thread each (None: num_threads)
    cuda_graph_tokens: int = 0  # capture CUDA graphs for steps of up to this many tokens (0: off)
    device_polling: str = "off"  # off | cuda | emulated (lamina.computenode.polling)
    micro_batches: int = 1  # slots in flight and ...
    max_step_tokens: int = 0  # ... tokens per micro-batch: polling's staging, made up front
    kernels: dict | None = None  # the KernelConfig's fields (None: the process's default)
    spin_us: float = SPIN_US  # how long receivers poll before sleeping (0: cores shared)
    idle_spin_us: float = SPIN_US  # how long the main thread polls its node rings when idle
    step_graph_tokens: int = 0  # whole decode steps of up to this many tokens as one graph (0: off)

    def torch_dtype(self) -> torch.dtype:
        from lamina.models import default_dtype
        return getattr(torch, self.dtype) if self.dtype else default_dtype(torch.device(self.device))
