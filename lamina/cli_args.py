"""The deployment flags every ``lamina`` command that serves a model takes (``generate``,
``bench``, ``launch``), and their translation into the config chain (:mod:`lamina.config`).

Each flag is a config setting (:data:`lamina.config.SETTINGS`): ``--kv-cache-gb`` is
``kv_cache_gb``, with the config's default. This module adds only what a command line needs on
top: the help text, the choices and the group of each flag. A command may choose other defaults
(``add_deployment_args(p, placement="ray")``)."""
from __future__ import annotations

import argparse

from lamina.config import (ATTENTION_KERNELS, GGUF_KERNELS, PLACEMENTS, POLLING, SCHEDULES,
                           SETTINGS, TRANSPORTS, deployment_config)
from lamina.types import KV_DTYPES

# setting -> (help, choices); the groups list the flags in --help order
_HELP: dict[str, tuple[str, tuple | None]] = {
    "model": ("builtin alias (smollm2), HF folder, .gguf file or pkg.module:function", None),
    "dtype": ("weights, activations and KV (default: float32 on CPU, bfloat16 on CUDA)",
              ("float32", "bfloat16", "float16")),
    "compute": ("compute replicas per instance", None),
    "memory": ("memory nodes per instance", None),
    "instances": ("instances (engine + replicas + memory pool) behind one router", None),
    "placement": ("where the roles run: inproc (one process), procs (a process each), ray (an "
                  "actor each)", PLACEMENTS),
    "transport": ("links between roles out of process: auto = shm on one host, tcp across hosts; "
                  "rdma = RDMA WRITE rings (needs pyverbs and an RDMA device)", TRANSPORTS),
    "address": ("ray: join this Ray cluster (default: start a local one)", None),
    "device": ("compute replica device (cpu, cpu:N, cpu:A-B, cuda:N)", None),
    "memory_device": ("memory node device (default: --device)", None),
    "cuda_graphs": ("replay decode steps' dense slices as CUDA graphs (--device cuda:N only); with "
                    "--device-polling, each decode step as one graph with its sends and waits", None),
    "device_polling": ("replicas queue each next slice behind a device flag that the attention "
                       "results release (cuda: needs cupy; emulated: CPU stand-in)", POLLING),
    "kernels": ("what every role computes with, by one name: the attention backend; torch also "
                "means torch linear layers, the Python ring and ATTEND path; gguf: the defaults "
                "with a GGUF model's linear layers on its own quantised blocks; gguf-q8: those "
                "blocks times 8-bit activations, as llama.cpp (faster, not exact) (default: "
                "$LAMINA_KERNELS, else auto)", (*ATTENTION_KERNELS, *GGUF_KERNELS)),
    "spare": ("procs: keep a role process started ahead, so that a role that dies comes "
              "back faster", None),
    "micro_batches": ("micro-batches in flight (default: 1; compute+1 when rotational)", None),
    "pipeline": ("staggered pipelining schedule (default: rotational when more than one "
                 "micro-batch or replica)", SCHEDULES),
    "adapt_micro_batches": ("one compute replica, --micro-batches >= 2: keep 1 or that many "
                            "in flight, whichever decodes faster, timed while serving", None),
    "attn_parts": ("send each memory node its share of a layer as up to this many mini-batches, "
                   "so it attends the first while the rest arrive", None),
    "kv_cache_gb": ("KV budget per memory node", None),
    "kv_cache_tokens": ("exact KV slots per memory node", None),
    "kv_dtype": ("how memory nodes store KV: auto (the model's dtype), float32, bfloat16, int8 or "
                 "fp8_e4m3 (8 bits with a scale per token and head), k16v8 (bfloat16 keys, int8 "
                 "values); 8-bit KV needs CPU memory nodes", KV_DTYPES),
    "prefix_caching": ("keep computed KV on the memory nodes for later requests that share "
                       "its prefix (their prefill computes only the rest)", None),
    "slab_size": ("KV slots per slab (the unit of lending and moving)", None),
    "max_num_seqs": ("requests running at once", None),
    "max_num_batched_tokens": ("tokens per step (the chunked-prefill budget)", None),
    "borrowing": ("with several instances, lend KV space between their pools", None),
    "plan_every": ("run the gManager's greedy KV placement every K rounds (0: reactive "
                   "borrowing only)", None),
}
_GROUPS = {
    None: ("model", "dtype"),
    "placement": ("compute", "memory", "instances", "placement", "transport", "address", "device",
                  "memory_device", "cuda_graphs", "device_polling", "kernels", "spare"),
    "pipelining": ("micro_batches", "pipeline", "attn_parts", "adapt_micro_batches"),
    "KV cache and scheduling": ("kv_cache_gb", "kv_cache_tokens", "kv_dtype", "prefix_caching",
                                "slab_size", "max_num_seqs", "max_num_batched_tokens",
                                "borrowing", "plan_every"),
}
_TYPES = {"kv_cache_tokens": int, "micro_batches": int}  # settings whose default is None


def add_deployment_args(p: argparse.ArgumentParser, **defaults) -> None:
    """Add the model, placement, pipeline, cache, scheduler and borrowing flags to ``p``, with
    the config's defaults except those given here."""
    for title, names in _GROUPS.items():
        g = p.add_argument_group(title) if title else p
        for name in names:
            help_, choices = _HELP[name]
            default = defaults.get(name, SETTINGS[name])
            flag = "--" + name.replace("_", "-")
            if isinstance(default, bool):
                g.add_argument(flag, action=argparse.BooleanOptionalAction, default=default,
                               help=help_)
            else:
                kind = _TYPES.get(name, str) if default is None else type(default)
                g.add_argument(flag, type=kind, default=default, choices=choices,
                               help=help_ + (f" (default: {default})" if name in defaults else ""))


def config_from_args(args: argparse.Namespace):
    """The config chain (a :class:`~lamina.config.DeploymentConfig`) of the flags added by
    :func:`add_deployment_args`."""
    return deployment_config(**{name: getattr(args, name) for name in _HELP})
