"""The deployment flags every ``lamina`` command that serves a model takes (``generate``,
``bench``, ``launch``), and their translation into the config chain (:mod:`lamina.config`).
Defaults come from the config dataclasses, never from here, except the placement, which each
command chooses (``launch``: ray; the others: procs)."""
from __future__ import annotations

import argparse

from lamina.config import (PLACEMENTS, POLLING, TRANSPORTS, CacheConfig, DeploymentConfig,
                           InstanceConfig, ModelConfig, SchedulerConfig, deployment_config)

_D, _C, _I, _S, _M = DeploymentConfig(), CacheConfig(), InstanceConfig(), SchedulerConfig(), ModelConfig()


def add_deployment_args(p: argparse.ArgumentParser, placement: str, memory: int = _I.memory) -> None:
    """Add the model, placement, pipeline, cache, scheduler and borrowing flags to ``p``."""
    p.add_argument("--model", default=_M.model,
                   help="builtin alias (smollm2), HF folder, .gguf file or pkg.module:function")
    p.add_argument("--dtype", default=_M.dtype, choices=["float32", "bfloat16", "float16"],
                   help="weights, activations and KV (default: float32 on CPU, bfloat16 on CUDA)")
    g = p.add_argument_group("placement")
    g.add_argument("--compute", type=int, default=1, help="compute replicas per instance")
    g.add_argument("--memory", type=int, default=memory, help="memory nodes per instance")
    g.add_argument("--instances", type=int, default=_D.instances,
                   help="instances (engine + replicas + memory pool) behind one router")
    g.add_argument("--placement", default=placement, choices=PLACEMENTS,
                   help=f"where the roles run: inproc (one process), procs (a process each), "
                        f"ray (an actor each) (default: {placement})")
    g.add_argument("--transport", default=_I.transport, choices=TRANSPORTS,
                   help="links between roles out of process: auto = shm on one host, tcp across "
                        "hosts; rdma = RDMA WRITE rings (needs pyverbs and an RDMA device)")
    g.add_argument("--address", help="ray: join this Ray cluster (default: start a local one)")
    g.add_argument("--device", default=_I.device, help="compute replica device")
    g.add_argument("--memory-device", help="memory node device (default: --device)")
    g.add_argument("--cuda-graphs", action="store_true",
                   help="replay decode steps' dense slices as CUDA graphs (--device cuda:N only)")
    g.add_argument("--device-polling", default=_I.device_polling, choices=POLLING,
                   help="replicas out of process queue each next slice behind a device flag that "
                        "the attention results release (cuda: needs cupy; emulated: CPU stand-in)")
    g = p.add_argument_group("pipelining")
    g.add_argument("--micro-batches", type=int, default=None,
                   help="micro-batches in flight (default: 1; compute+1 when rotational)")
    g.add_argument("--pipeline", default=None, choices=["none", "fixed", "rotational"],
                   help="staggered pipelining schedule (default: rotational when more than one "
                        "micro-batch or replica)")
    g.add_argument("--attn-parts", type=int, default=1,
                   help="send each memory node its share of a layer as up to this many "
                        "mini-batches, so it attends the first while the rest arrive")
    g = p.add_argument_group("KV cache and scheduling")
    g.add_argument("--kv-cache-gb", type=float, default=_C.kv_cache_gb, help="KV budget per memory node")
    g.add_argument("--kv-cache-tokens", type=int, default=_C.kv_cache_tokens,
                   help="exact KV slots per memory node")
    g.add_argument("--slab-size", type=int, default=_C.slab_size,
                   help="KV slots per slab (the unit of lending and moving)")
    g.add_argument("--max-num-seqs", type=int, default=_S.max_num_seqs)
    g.add_argument("--max-num-batched-tokens", type=int, default=_S.max_num_batched_tokens)
    g.add_argument("--no-borrowing", dest="borrowing", action="store_false",
                   help="with several instances, do not lend KV space between their pools")
    g.add_argument("--plan-every", type=int, default=_D.plan_every, metavar="K",
                   help="run the gManager's greedy KV placement every K rounds (0: reactive "
                        "borrowing only)")


def config_from_args(args: argparse.Namespace) -> DeploymentConfig:
    """The config chain of the flags added by :func:`add_deployment_args`."""
    return deployment_config(
        args.model, compute=args.compute, memory=args.memory, instances=args.instances,
        placement=args.placement, pipeline=args.pipeline, micro_batches=args.micro_batches,
        attn_parts=args.attn_parts, borrowing=args.borrowing, plan_every=args.plan_every,
        device=args.device, memory_device=args.memory_device, dtype=args.dtype,
        kv_cache_gb=args.kv_cache_gb, kv_cache_tokens=args.kv_cache_tokens,
        slab_size=args.slab_size, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, transport=args.transport,
        address=args.address, cuda_graphs=args.cuda_graphs, device_polling=args.device_polling)
