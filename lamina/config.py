"""One configuration chain, passed down whole: model -> cache -> scheduler -> instance ->
deployment (-> server, for ``lamina launch``). Defaults live here and nowhere else; ``LLM``,
the CLI and the server build a :class:`DeploymentConfig` from flat settings named after its
fields (:data:`SETTINGS`, :func:`deployment_config`).
"""
from __future__ import annotations

from dataclasses import MISSING, Field, dataclass, field, fields
from typing import Any

import torch

from lamina import env
from lamina.device import Device, default_cores, parse, split
from lamina.types import KV_DTYPES

SCHEDULES = ("none", "fixed", "rotational")  # pipelines (lamina.computenode.schedule)
PLACEMENTS = ("inproc", "procs", "ray")
TRANSPORTS = ("auto", "shm", "tcp", "rdma")
POLLING = ("off", "cuda", "emulated")
ATTENTION_KERNELS = ("auto", "cpp", "triton", "torch", "batched", "ref")
LINEAR_KERNELS = ("auto", "packed", "gguf", "gguf-q8", "torch")
GGUF_KERNELS = ("gguf", "gguf-q8")  # linear choices that read a GGUF's blocks (kernels names too)
RING_CODECS = ("auto", "cpp", "python")
NODE_PLANES = ("auto", "native", "python")
SLICE_RUNNERS = ("auto", "native", "fx")


@dataclass(frozen=True)
class KernelConfig:
    """What a role computes with; every role of an instance gets its instance's choices.

    * ``attention``: the memory nodes' paged attention and the replicas' merge: ``auto`` (Triton
      on CUDA, the C++ kernel on CPU where it builds, else torch), ``cpp``, ``triton``,
      ``torch``, ``batched``, ``ref`` (:mod:`lamina.kernels.dispatch`);
    * ``linear``: decode-sized linear layers on CPU: ``auto`` (the packed C++ kernel where it
      builds), ``packed`` (that kernel or an error), ``gguf`` (a GGUF model's own Q4_0 / Q4_1 /
      Q8_0 blocks for calls of a few rows, the packed kernel for the rest:
      :mod:`lamina.computenode.gguf_linear`), ``gguf-q8`` (the same blocks with the activations
      quantised to 8 bits and integer dot products, as llama.cpp: faster, not exact),
      ``torch`` (:mod:`lamina.computenode.cpu_linear`);
    * ``ring``: the shared-memory ring's codec: ``auto`` (the C++ fast path where it builds),
      ``cpp`` (that or an error), ``python`` (:mod:`lamina.transport.shm_fast`);
    * ``plane``: who serves a memory node's ATTENDs: ``auto`` (the native plane where it builds
      and applies), ``native`` (that or an error), ``python`` (:mod:`lamina.memnode.native`);
    * ``slices``: who runs a CPU replica's slices: ``auto`` (each slice as a C++ program where
      the extension builds and the slice translates), ``native`` (that or an error), ``fx``
      (the slices' generated Python code; :mod:`lamina.computenode.native_slice`).
    """

    attention: str = "auto"
    linear: str = "auto"
    ring: str = "auto"
    plane: str = "auto"
    slices: str = "auto"

    def __post_init__(self) -> None:
        for name, choices in (("attention", ATTENTION_KERNELS), ("linear", LINEAR_KERNELS),
                              ("ring", RING_CODECS), ("plane", NODE_PLANES),
                              ("slices", SLICE_RUNNERS)):
            if getattr(self, name) not in choices:
                raise ValueError(f"{name} kernels {getattr(self, name)!r}: expected one of "
                                 f"{', '.join(choices)}")

    @classmethod
    def named(cls, name: str) -> "KernelConfig":
        """The choices by one name, as ``LAMINA_KERNELS`` and ``--kernels`` give them: an
        attention backend, with torch linear layers unless it is ``auto`` or ``cpp``; ``torch``
        also means the Python ring and ATTEND path (no C++ at all); ``gguf`` / ``gguf-q8``: the
        defaults with that linear choice."""
        if name in GGUF_KERNELS:
            return cls(linear=name)
        if name not in ATTENTION_KERNELS:
            raise ValueError(f"kernels {name!r} (LAMINA_KERNELS / --kernels): expected one of "
                             f"{', '.join(ATTENTION_KERNELS + GGUF_KERNELS)}")
        python = "python" if name == "torch" else "auto"
        return cls(name, "auto" if name in ("auto", "cpp") else "torch", python, python,
                   "fx" if name == "torch" else "auto")


_KERNELS: list[KernelConfig] = []  # this process's choices, once a role or deployment set them


def kernels_in_use() -> KernelConfig:
    """This process's kernel choices: its role's (:func:`use_kernels`), else what
    ``LAMINA_KERNELS`` named when Lamina was imported."""
    return _KERNELS[0] if _KERNELS else KernelConfig.named(env.KERNELS)


def use_kernels(kernels: KernelConfig) -> KernelConfig:
    """Make ``kernels`` this process's choices; returns the previous ones (to put back)."""
    previous = kernels_in_use()
    _KERNELS[:] = [kernels]
    return previous


@dataclass(frozen=True)
class ModelConfig:
    """``model``: builtin alias, HF folder, GGUF file or ``pkg.module:function``; ``dtype``
    a torch dtype name (None: float32 on CPU, bfloat16 on CUDA)."""

    model: str = "smollm2"
    dtype: str | None = None

    @property
    def torch_dtype(self) -> torch.dtype | None:
        return getattr(torch, self.dtype) if self.dtype else None


@dataclass(frozen=True)
class CacheConfig:
    """KV budget per memory node: ``kv_cache_gb``, or exactly ``kv_cache_tokens`` slots;
    ``slab_size`` slots are the unit of lending and moving KV between pools; ``kv_dtype``: how
    pools store K and V (:mod:`lamina.kernels.kv_format`: ``auto`` is the model's dtype;
    ``float32``, ``bfloat16``, ``int8``, ``fp8_e4m3``, ``k16v8`` = bfloat16 keys, int8 values);
    ``prefix_caching``: computed KV stays on the nodes, shared by later requests with the same
    prefix, until the space is needed (:mod:`lamina.engine.prefix_cache`)."""

    kv_cache_gb: float = 1.0
    kv_cache_tokens: int | None = None
    slab_size: int = 256
    kv_dtype: str = "auto"
    prefix_caching: bool = True

    def __post_init__(self) -> None:
        if self.kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_dtype {self.kv_dtype!r}: expected one of {', '.join(KV_DTYPES)}")
        if self.kv_cache_tokens is not None and self.kv_cache_tokens < 1:
            raise ValueError(f"kv_cache_tokens must be >= 1, got {self.kv_cache_tokens}")
        if self.slab_size < 1:
            raise ValueError(f"slab_size must be >= 1, got {self.slab_size}")


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching: at most ``max_num_seqs`` requests running, ``max_num_batched_tokens``
    tokens per step (the chunked-prefill budget; 2048 as vLLM's CPU server: a batch of long
    prompts gets its first tokens close together, so its requests decode together instead of
    the first ones finishing while the last still prefill); ``max_model_len``: the model's
    context (None: the model's own, filled in when the model is loaded)."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048  # chunked-prefill token budget per step
    max_model_len: int | None = None


@dataclass(frozen=True)
class PipelineConfig:
    """``micro_batches`` in flight under ``schedule`` on ``replicas`` compute replicas; each
    node gets its share of a layer as up to ``attn_parts`` mini-batches (1: one ATTEND).
    ``adapt`` (one replica, ``micro_batches`` > 1): the engine keeps 1 or ``micro_batches`` in
    flight, whichever decodes faster as it times them while serving."""

    schedule: str = "none"
    micro_batches: int = 1
    replicas: int = 1
    attn_parts: int = 1
    adapt: bool = False

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULES:
            raise ValueError(f"unknown pipeline {self.schedule!r}; expected one of "
                             f"{', '.join(SCHEDULES)}")
        if self.micro_batches < 1 or self.replicas < 1 or self.attn_parts < 1:
            raise ValueError("micro_batches, compute replicas and attn_parts must be >= 1")
        if self.schedule == "none" and (self.micro_batches, self.replicas) != (1, 1):
            raise ValueError("pipeline 'none' runs one micro-batch on one compute replica; use "
                             "--pipeline fixed or rotational for more")
        if self.micro_batches < self.replicas:
            raise ValueError(f"{self.micro_batches} micro-batches cannot keep {self.replicas} "
                             f"compute replicas busy: use at least as many micro-batches")
        if self.adapt and (self.replicas != 1 or self.micro_batches < 2):
            raise ValueError("adapt_micro_batches times one micro-batch against micro_batches on "
                             f"one compute replica: it needs compute=1 and micro_batches >= 2 "
                             f"(got compute={self.replicas}, micro_batches={self.micro_batches})")


def resolve_pipeline(pipeline: str | None, micro_batches: int | None,
                     compute: int, attn_parts: int = 1, adapt: bool = False) -> PipelineConfig:
    """Defaults as in Lamina: more than one micro-batch or replica means rotational, with
    ``n = N + 1`` micro-batches on ``N`` replicas (2 on one replica); ``fixed`` defaults to one
    micro-batch per replica."""
    if pipeline is None:
        pipeline = "rotational" if (micro_batches or 1) > 1 or compute > 1 else "none"
    if micro_batches is None:
        micro_batches = {"none": 1, "fixed": compute}.get(pipeline, compute + 1)
    return PipelineConfig(pipeline, micro_batches, compute, attn_parts, adapt)


@dataclass(frozen=True)
class InstanceConfig:
    """One instance: ``pipeline.replicas`` compute replicas on ``device`` and ``memory`` memory
    nodes on ``memory_device`` (default: ``device``), placed by ``placement``:

    * ``inproc``: every role in the engine's process (local calls, shared weights);
    * ``procs``: every role a process of its own on this host (shm channels);
    * ``ray``: every role a Ray actor (shm on one host, tcp across hosts; ``address`` joins a
      running cluster).

    ``device`` / ``memory_device``: ``cpu``, ``cpu:N``, ``cpu:A-B`` (the cores the role owns:
    it pins itself to them and runs that many threads), ``cuda:N`` (:mod:`lamina.device`).
    ``transport`` picks the links between roles out of process (``rdma``: RC queue pairs via
    pyverbs, refused at start where pyverbs or a device is missing; ``auto``: shm on one host,
    tcp across hosts); ``num_threads`` is the torch thread count of a role that owns no cores;
    ``spin``: a memory node alone on its cores (one instance per host) polls its replicas' shm
    links instead of sleeping on them (replicas never poll: their cores run the slices).
    ``cuda_graphs``: replicas on a CUDA ``device`` capture their slices as CUDA graphs for
    decode steps of up to ``max_num_seqs`` tokens and replay them (off by default until
    verified on a GPU; refused on any other device). ``device_polling``: replicas
    pre-launch each next slice behind a device flag the attention results release
    (:mod:`lamina.computenode.polling`): ``cuda`` needs a CUDA ``device`` and cupy (and, in
    process, memory nodes off the GPU); ``emulated`` is its CPU stand-in (the same
    bookkeeping, slices deferred), for tests. Both together (``inproc`` or ``procs``: the
    memory nodes on the replicas' host): each decode step is one graph of every slice with its
    sends and waits over the step mailbox (:mod:`lamina.computenode.step_graphs`), ``emulated``
    being its CPU stand-in. ``kernels``: what every role of the instance computes with (:class:`KernelConfig`, or its one-name form; default: what
    ``LAMINA_KERNELS`` names). ``spare`` (``procs`` only): keep one role process started
    ahead, its imports done, so that a role that dies comes back without Python's start and
    imports (an idle process holding torch's memory; off by default)."""

    memory: int = 1
    placement: str = "inproc"
    device: str = "cpu"
    memory_device: str | None = None
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    transport: str = "auto"
    address: str | None = None
    num_threads: int = 1
    spin: bool = True
    cuda_graphs: bool = False
    device_polling: str = "off"
    kernels: KernelConfig | str | None = None  # None: what LAMINA_KERNELS names
    spare: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.kernels, KernelConfig):  # a name, as --kernels gives it, or None
            object.__setattr__(self, "kernels", KernelConfig.named(self.kernels or env.KERNELS))
        if self.memory < 1:
            raise ValueError(f"memory must be >= 1, got {self.memory}")
        if self.placement not in PLACEMENTS:
            raise ValueError(f"placement must be one of {', '.join(PLACEMENTS)}; got "
                             f"{self.placement!r}")
        if self.spare and self.placement != "procs":
            raise ValueError(f"spare keeps a role process ahead under placement 'procs'; "
                             f"got placement {self.placement!r}")
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {', '.join(TRANSPORTS)}; got "
                             f"{self.transport!r}")
        device = parse(self.device)
        if device.kind != "cuda" and self.cuda_graphs and self.device_polling != "emulated":
            raise ValueError(f"cuda_graphs needs a CUDA compute device (device='cuda:0'); "
                             f"got device={self.device!r}")
        if self.device_polling not in POLLING:
            raise ValueError(f"device_polling must be one of {', '.join(POLLING)}; got {self.device_polling!r}")
        if self.device_polling == "cuda" and self.placement == "inproc" \
                and parse(self.node_device).kind == "cuda":
            raise ValueError("device_polling='cuda' with in-process memory nodes on the GPU: their "
                             "attention would make CUDA calls while a slice waits on its flag; "
                             "put the memory nodes on the CPU or out of process")
        if self.device_polling != "off" and self.cuda_graphs and self.placement == "ray":
            raise ValueError("device_polling with cuda_graphs (whole decode steps as one graph) "
                             "needs the memory nodes on the replicas' host, which placement "
                             "'ray' does not promise: use placement 'inproc' or 'procs'")
        if self.device_polling == "cuda" and device.kind != "cuda":  # cupy: checked at start
            raise ValueError(f"device-side polling needs a CUDA compute device; got "
                             f"device={self.device!r}")
        parse(self.node_device)

    @property
    def compute(self) -> int:
        return self.pipeline.replicas

    @property
    def node_device(self) -> str:
        return self.memory_device or self.device

    def role_devices(self) -> tuple[list[Device], list[Device]]:
        """The device of each compute replica and of each memory node. Cores named on a device
        are split among its roles. Under ``procs`` with no cores named at all, the host's cores
        are split between the two sides (:func:`lamina.device.default_cores`); ``inproc`` roles
        share the engine's process, ``ray`` roles pin only to cores named."""
        cd, md = parse(self.device), parse(self.node_device)
        unnamed = cd.kind == md.kind == "cpu" and cd.cores is None and md.cores is None
        if self.placement == "procs" and unnamed:
            cd, md = default_cores(self.compute, self.memory)
        return split(cd, self.compute), split(md, self.memory)


@dataclass(frozen=True)
class DeploymentConfig:
    """``instances`` instances behind one router; with ``borrowing`` (and more than one
    instance) their pools lend KV space to each other through a gManager (``plan_every``:
    run its greedy placement every that many rounds; 0: reactive borrowing only)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    instance: InstanceConfig = field(default_factory=InstanceConfig)
    instances: int = 1
    borrowing: bool = True
    plan_every: int = 0
    beta_thres: int = 8
    util_thres: float = 0.5

    def __post_init__(self) -> None:
        if self.instances < 1:
            raise ValueError(f"instances must be >= 1, got {self.instances}")

    @property
    def lends(self) -> bool:
        """Whether pools lend to each other (borrowing on, more than one instance)."""
        return self.borrowing and self.instances > 1


@dataclass(frozen=True)
class ServerConfig:
    """The OpenAI-compatible server of ``lamina launch`` (binds loopback unless told)."""

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    served_model_name: str | None = None
    max_queued_requests: int = 1024  # beyond the running ones; one more is answered 429


# -- flat settings ----------------------------------------------------------------------------------
# ``LLM(model, **settings)`` and the CLI's flags name each setting by its field: every field of
# ModelConfig, CacheConfig, SchedulerConfig, InstanceConfig and DeploymentConfig, except that the
# instance's ``pipeline`` is given as its parts (``compute``; ``pipeline``, the schedule's name;
# ``micro_batches``; ``attn_parts``; ``adapt_micro_batches``), which :func:`resolve_pipeline`
# completes.
_NESTED = {"model", "cache", "scheduler", "instance", "pipeline"}  # configs within configs
_SECTIONS = (ModelConfig, CacheConfig, SchedulerConfig, InstanceConfig, DeploymentConfig)


def _own(cls) -> list[Field]:
    return [f for f in fields(cls) if f.name not in _NESTED or cls is ModelConfig]


def _default(f: Field) -> Any:
    return f.default_factory() if f.default is MISSING else f.default


#: every flat setting and its default
SETTINGS: dict[str, Any] = {
    **{f.name: _default(f) for cls in _SECTIONS for f in _own(cls)},
    "compute": PipelineConfig.replicas, "pipeline": None, "micro_batches": None,
    "attn_parts": PipelineConfig.attn_parts, "adapt_micro_batches": PipelineConfig.adapt}


def dtype_name(dtype: torch.dtype | str | None) -> str | None:
    """``float32`` for ``torch.float32`` or ``"float32"`` (None stays None)."""
    return None if dtype is None else str(dtype).removeprefix("torch.")


def deployment_config(model: str | None = None, **settings: Any) -> DeploymentConfig:
    """The chain from flat settings (see :data:`SETTINGS`), each left out keeping its default;
    ``model`` may also be given first. Unknown names raise ``TypeError``; invalid values
    ``ValueError`` (from the dataclass that holds them)."""
    unknown = sorted(set(settings) - set(SETTINGS))
    if unknown:
        raise TypeError(f"unknown setting(s) {', '.join(unknown)}; the settings are "
                        f"{', '.join(SETTINGS)}")
    if model is not None:
        settings["model"] = str(model)
    if "dtype" in settings:
        settings["dtype"] = dtype_name(settings["dtype"])
    s = {**SETTINGS, **settings}

    def take(cls) -> dict[str, Any]:
        return {f.name: s[f.name] for f in _own(cls)}

    pipeline = resolve_pipeline(s["pipeline"], s["micro_batches"], s["compute"], s["attn_parts"],
                                s["adapt_micro_batches"])
    return DeploymentConfig(ModelConfig(**take(ModelConfig)), CacheConfig(**take(CacheConfig)),
                            SchedulerConfig(**take(SchedulerConfig)),
                            InstanceConfig(**take(InstanceConfig), pipeline=pipeline),
                            **take(DeploymentConfig))
