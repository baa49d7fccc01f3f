"""Analytical cost model of attention offloading (Lamina §3-4), decode phase only.

Units: seconds, bytes, FLOP, bytes/s, FLOP/s, tokens/s, US dollars. ``B`` = tokens per decode
step (= requests in flight), ``c`` = KV length each request's attention reads (for a request,
use the average over its decode: prompt + output/2). Dense part on compute devices:
``t_m(B) = max(B*2N / (F*MFU(B)), e*N / mem_bw)`` (:func:`nonattn_time`); attention on memory
devices: ``t_a = B*c*kv_bytes_per_token / mem_bw`` (:func:`attn_time`); transfers
``B*L*e*(2HD + 2HkvD)`` bytes per step (:func:`min_interconnect_bandwidth` derives the paper's
``2*e*d*L*F*MFU/N``). ``MFU(B) = mfu_max*B/(B + b_half)`` (:class:`MfuCurve`) is an affine step
time ``2N*(B + b_half)/(F*mfu_max)``: a fixed cost worth ``b_half`` tokens plus a per-token
cost. Defaults 0.30 / 64 stand for *end-to-end* decode MFU of serving systems, not GEMM
micro-benchmarks (0.6-0.7); pass a measured float or curve to override.
Not modelled: prefill, tensor-parallel communication, activation memory, host and NIC prices.
"""
from __future__ import annotations

import json
import math
from functools import cached_property
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Union

from lamina.costmodel.hardware import Device


class Infeasible(ValueError):
    """A deployment cannot run the workload (weights or KV do not fit); message says why."""


# Bytes of one K and one V element in each KV format (lamina.kernels.kv_format, which the cost
# model does not import: it needs no torch); an 8-bit part adds a float32 scale per token and head.
KV_ELEMENT_BYTES = {"float32": (4, 4), "bfloat16": (2, 2), "int8": (1, 1), "fp8_e4m3": (1, 1),
                    "k16v8": (2, 1)}


@dataclass(frozen=True)
class ModelSpec:
    """Shape of a dense decoder-only transformer with a gated MLP (LLaMA family).

    ``dtype_bytes`` (e) is the size of weights, transferred activations and, with ``kv_dtype``
    ``auto``, of KV; another ``kv_dtype`` (``KV_ELEMENT_BYTES``) prices KV at its own bytes."""

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    dtype_bytes: int = 2
    tie_embeddings: bool = False
    kv_dtype: str = "auto"

    def __post_init__(self) -> None:
        for k in ("layers", "hidden", "heads", "kv_heads", "head_dim", "intermediate", "vocab", "dtype_bytes"):
            v = getattr(self, k)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"model {self.name!r}: {k} must be a positive int, got {v!r}")
        if self.kv_dtype != "auto" and self.kv_dtype not in KV_ELEMENT_BYTES:
            raise ValueError(f"model {self.name!r}: kv_dtype {self.kv_dtype!r}: expected auto or "
                             f"one of {', '.join(KV_ELEMENT_BYTES)}")
        if self.heads % self.kv_heads:
            raise ValueError(f"model {self.name!r}: heads={self.heads} not a multiple of kv_heads={self.kv_heads}")

    @cached_property
    def layer_params(self) -> int:
        """Weights of one layer: q, k, v, o projections + gate, up, down (norms ignored)."""
        d, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        return d * q + 2 * d * kv + q * d + 3 * d * self.intermediate

    @cached_property
    def params(self) -> int:
        """Stored parameters: layers + embedding (+ separate LM head unless tied)."""
        return self.layers * self.layer_params + self.vocab * self.hidden * (1 if self.tie_embeddings else 2)

    @cached_property
    def weight_bytes(self) -> int:
        return self.params * self.dtype_bytes

    @cached_property
    def active_params(self) -> int:
        """Parameters multiplied per token (layers + LM head; the embedding is a lookup)."""
        return self.layers * self.layer_params + self.vocab * self.hidden

    @cached_property
    def flops_per_token(self) -> int:
        """Dense (non-attention) FLOP per token: 2 per multiply-accumulate."""
        return 2 * self.active_params

    @cached_property
    def kv_bytes_per_token(self) -> int:
        """KV cache bytes per token over all layers: 2 (k and v) * L * Hkv * D * e, or in
        ``kv_dtype``'s bytes (an 8-bit part's scales included)."""
        if self.kv_dtype == "auto":
            return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes
        per_head = sum(b * self.head_dim + (4 if b == 1 else 0)
                       for b in KV_ELEMENT_BYTES[self.kv_dtype])
        return self.layers * self.kv_heads * per_head

    @cached_property
    def transfer_bytes_per_token(self) -> int:
        """Bytes crossing the network per token per step: L * e * (q + k + v + attn_out)."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        return self.layers * self.dtype_bytes * (2 * q + 2 * kv)

    @classmethod
    def from_hf_config(cls, cfg: Any, name: str | None = None, dtype_bytes: int | None = None) -> "ModelSpec":
        """Build from a Hugging Face config (dict, ``PretrainedConfig`` or object with the usual
        attributes). Mixture-of-experts configs are rejected (their FLOPs differ)."""
        d = cfg if isinstance(cfg, Mapping) else (cfg.to_dict() if hasattr(cfg, "to_dict") else vars(cfg))

        def get(*keys: str, default: Any = None) -> Any:
            for k in keys:
                if d.get(k) is not None:
                    return d[k]
            if default is None:
                raise ValueError(f"HF config {name or d.get('_name_or_path', '')!r}: missing {keys[0]!r}")
            return default

        for k in ("num_local_experts", "num_experts", "n_routed_experts"):
            if (d.get(k) or 0) > 1:
                raise ValueError(f"HF config {name or ''!r}: mixture-of-experts ({k}={d[k]}) is not modelled")
        hidden, heads = int(get("hidden_size", "n_embd")), int(get("num_attention_heads", "n_head"))
        e = dtype_bytes or {"float32": 4, "float64": 8, "float8_e4m3fn": 1}.get(
            str(d.get("torch_dtype") or d.get("dtype") or "bfloat16"), 2)
        return cls(
            name=name or str(d.get("_name_or_path") or d.get("model_type") or "hf-model"),
            layers=int(get("num_hidden_layers", "n_layer")), hidden=hidden, heads=heads,
            kv_heads=int(get("num_key_value_heads", default=heads)),
            head_dim=int(get("head_dim", default=hidden // heads)),
            intermediate=int(get("intermediate_size", "n_inner", default=4 * hidden)),
            vocab=int(get("vocab_size")), dtype_bytes=int(e),
            tie_embeddings=bool(d.get("tie_word_embeddings", False)))


PRESETS: dict[str, ModelSpec] = {
    "smollm2": ModelSpec("smollm2", 30, 576, 9, 3, 64, 1536, 49152, tie_embeddings=True),
    "llama-13b": ModelSpec("llama-13b", 40, 5120, 40, 40, 128, 13824, 32000),
    "llama-33b": ModelSpec("llama-33b", 60, 6656, 52, 52, 128, 17920, 32000),
    "llama-65b": ModelSpec("llama-65b", 80, 8192, 64, 64, 128, 22016, 32000),
}


def load_model_spec(name_or_path: str) -> ModelSpec:
    """A preset name (case-insensitive) or a path to an HF ``config.json`` / model folder."""
    if name_or_path.lower() in PRESETS:
        return PRESETS[name_or_path.lower()]
    p = Path(name_or_path)
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        raise ValueError(f"unknown model {name_or_path!r}: not a preset ({', '.join(PRESETS)}) "
                         "nor an HF config.json / folder")
    try:
        cfg = json.loads(p.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{p}: cannot read HF config: {e}") from e
    return ModelSpec.from_hf_config(cfg, name=p.parent.name if p.name == "config.json" else p.stem)


@dataclass(frozen=True)
class MfuCurve:
    """``MFU(B) = mfu_max * B / (B + b_half)``: rises with batch, saturates at ``mfu_max``."""

    mfu_max: float = 0.30
    b_half: float = 64.0

    def __call__(self, tokens: float) -> float:
        return self.mfu_max * tokens / (tokens + self.b_half)


MfuLike = Union[float, Callable[[float], float]]
DEFAULT_MFU = MfuCurve()


def mfu_at(mfu: MfuLike, tokens: float) -> float:
    """MFU for a step of ``tokens`` tokens: a constant float or a curve. Must be in (0, 1]."""
    v = float(mfu(tokens)) if callable(mfu) else float(mfu)
    if not 0 < v <= 1:
        raise ValueError(f"MFU must be in (0, 1], got {v} at B={tokens}")
    return v


def nonattn_time(model: ModelSpec, dev: Device, tokens: float, mfu: MfuLike = DEFAULT_MFU,
                 n_devices: int = 1) -> float:
    """Seconds for the dense part of one decode step of ``tokens`` tokens (all L layers and
    the LM head) on ``n_devices`` devices sharing the weights (TP; communication ignored):
    ``max(FLOPs / (n * peak * MFU(tokens)), streamed weight bytes / (n * mem_bw))``."""
    compute = tokens * model.flops_per_token / (n_devices * dev.flops * mfu_at(mfu, tokens))
    weights = model.active_params * model.dtype_bytes / (n_devices * dev.mem_bw)
    return max(compute, weights)


def attn_time(model: ModelSpec, dev: Device, tokens: float, context: float, n_devices: int = 1,
              bw_efficiency: float = 1.0) -> float:
    """Seconds for decode attention of ``tokens`` requests of KV length ``context`` (all
    layers) spread evenly over ``n_devices``: KV bytes read / bandwidth (FLOP floor kept)."""
    kv_read = tokens * context * model.kv_bytes_per_token
    flops = tokens * 4 * model.layers * model.heads * model.head_dim * context
    return max(kv_read / (n_devices * dev.mem_bw * bw_efficiency), flops / (n_devices * dev.flops))


def layer_times(model: ModelSpec, compute: Device, memory: Device, tokens: float, context: float,
                mfu: MfuLike = DEFAULT_MFU) -> tuple[float, float]:
    """Per-layer ``(t_m, t_a)`` in seconds on one compute and one memory device (LM head excluded)."""
    p, e = model.layer_params, model.dtype_bytes
    t_m = max(2 * tokens * p / (compute.flops * mfu_at(mfu, tokens)), e * p / compute.mem_bw)
    return t_m, attn_time(model, memory, tokens, context) / model.layers


def min_interconnect_bandwidth(model: ModelSpec, dev: Device, tokens: float,
                               mfu: MfuLike = DEFAULT_MFU, n_devices: int = 1) -> float:
    """Bytes/s the compute side must move so that transfers hide under its compute.

    Derivation. In one decode step of B tokens, per layer and token, the compute node sends
    q (H*D), k and v (Hkv*D each) and receives the attention output (H*D): ``e*(2HD + 2HkvD)``
    bytes, ``4*e*d`` for multi-head attention. Per step that is ``S = 4*e*d*L*B``. With staggered
    pipelining these transfers overlap the dense compute of another micro-batch, which lasts
    ``t_m(B) = 2*N*B / (F*MFU(B))`` (N = parameters multiplied per token, F = peak FLOP/s).
    Hiding needs ``S / t_m <= bandwidth``, so ``BW_min = 4edLB * F * MFU(B) / (2NB) =
    2*e*d*L*F*MFU(B) / N`` (Lamina Table 3). B cancels except through MFU: the need grows with
    batch and saturates with MFU; since N ~ 12*d^2*L it is ~ e*F*MFU/(6d), smaller for larger
    models. Here ``t_m`` is :func:`nonattn_time` (so a weight-bandwidth-bound step, achieved
    MFU below the curve, needs less) and GQA shrinks k/v. Both directions are summed.
    """
    return tokens * model.transfer_bytes_per_token / nonattn_time(model, dev, tokens, mfu, n_devices)


def paper_min_bandwidth(dtype_bytes: float, hidden: float, layers: float, params: float,
                        peak_flops: float, mfu: float) -> float:
    """Closed form ``2 * e * d * L * F * MFU / N`` in bytes/s (MHA, compute-bound)."""
    return 2 * dtype_bytes * hidden * layers * peak_flops * mfu / params


@dataclass(frozen=True)
class Assumptions:
    """Knobs of the deployment model. ``max_batch``: tokens per step per compute replica
    (latency cap); ``usable_memory``: fraction of device memory for weights/KV;
    ``microbatches``: in flight per replica (1 = no overlap, times add; >= 2 = staggered
    pipelining, the busiest resource sets the pace); ``bw_efficiency``: achieved/peak memory
    bandwidth in attention."""

    mfu: MfuLike = DEFAULT_MFU
    max_batch: int = 1024
    usable_memory: float = 0.9
    microbatches: int = 2
    bw_efficiency: float = 1.0


DEFAULT = Assumptions()


@dataclass(frozen=True)
class Estimate:
    """Steady-state decode estimate of one deployment (``memory is None``: homogeneous)."""

    compute: Device
    n_compute: int
    memory: Device | None
    n_memory: int
    context: int
    batch: int  # tokens per step over the whole deployment
    t_compute: float  # s per step, dense part (all micro-batches)
    t_attention: float  # s per step
    t_network: float  # s per step
    step_time: float  # s
    bottleneck: str  # compute | weight bandwidth | attention | network
    batch_limit: str  # max batch | KV capacity

    @property
    def throughput(self) -> float:
        return self.batch / self.step_time

    @property
    def cost_usd(self) -> float:
        return self.n_compute * self.compute.price_usd + self.n_memory * (self.memory.price_usd if self.memory else 0)

    @property
    def per_dollar(self) -> float:
        return self.throughput / self.cost_usd

    def label(self) -> str:
        mem = f" + {self.memory.name} x{self.n_memory}" if self.memory else " (homogeneous)"
        return f"{self.compute.name} x{self.n_compute}{mem}"


def tp_degree(model: ModelSpec, dev: Device, a: Assumptions = DEFAULT) -> int:
    """Fewest devices whose usable memory holds the weights."""
    return max(1, math.ceil(model.weight_bytes / (a.usable_memory * dev.memory_bytes)))


def _compute_period(model: ModelSpec, dev: Device, per_replica: float, tp: int, a: Assumptions) -> float:
    n = a.microbatches
    return n * nonattn_time(model, dev, per_replica / n, a.mfu, tp)


def _dense_kind(model: ModelSpec, dev: Device, tokens: float, tp: int, mfu: MfuLike) -> str:
    """'weight bandwidth' when streaming the weights, not the FLOPs, sets the dense time."""
    compute = tokens * model.flops_per_token / (tp * dev.flops * mfu_at(mfu, tokens))
    return "weight bandwidth" if model.active_params * model.dtype_bytes / (tp * dev.mem_bw) > compute else "compute"


def offloaded(model: ModelSpec, compute: Device, memory: Device, n_compute: int, n_memory: int,
              context: int, a: Assumptions = DEFAULT, batch: int | None = None,
              tp: int | None = None) -> Estimate:
    """Attention-offloaded deployment: weights on ``n_compute`` compute devices (replicas of
    ``tp`` devices; default and minimum :func:`tp_degree`), KV and attention on ``n_memory``
    memory devices. ``batch`` defaults to the largest that fits (replicas * max_batch, KV
    capacity). Raises Infeasible."""
    tp_min = tp_degree(model, compute, a)
    tp = tp or tp_min
    if tp < tp_min or n_compute < tp or n_compute % tp or n_memory < 1:
        raise Infeasible(f"{compute.name} x{n_compute}: weights need a multiple of {tp_min} devices"
                         f" ({tp} asked) and at least one memory device (got {n_memory})")
    replicas = n_compute // tp
    kv_cap = math.floor(n_memory * a.usable_memory * memory.memory_bytes / (context * model.kv_bytes_per_token) + 1e-9)
    b = min(replicas * a.max_batch, kv_cap) if batch is None else batch
    if b < 1 or b > kv_cap:
        raise Infeasible(f"{memory.name} x{n_memory} holds KV for {kv_cap} requests of {context} tokens")
    per_rep = b / replicas
    times = {"compute": _compute_period(model, compute, per_rep, tp, a),
             "attention": attn_time(model, memory, b, context, n_memory, a.bw_efficiency),
             "network": b * model.transfer_bytes_per_token / min(n_compute * compute.nic_bw, n_memory * memory.nic_bw)}
    step = sum(times.values()) if a.microbatches == 1 else max(times.values())
    neck = max(times, key=times.get)
    if neck == "compute":
        neck = _dense_kind(model, compute, per_rep / a.microbatches, tp, a.mfu)
    return Estimate(compute, n_compute, memory, n_memory, context, b, times["compute"], times["attention"],
                    times["network"], step, neck,
                    "KV capacity" if b == kv_cap and b < replicas * a.max_batch else "max batch")


def homogeneous(model: ModelSpec, dev: Device, n_devices: int, context: int,
                a: Assumptions = DEFAULT, batch: int | None = None, tp: int | None = None) -> Estimate:
    """Compute devices alone: each replica of ``tp`` devices (default and minimum
    :func:`tp_degree`; more leaves more room for KV) holds weights and its KV, and runs the
    dense part then attention on the same memory (times add). ``batch`` is per replica and
    defaults to the largest that fits. Raises Infeasible."""
    tp_min = tp_degree(model, dev, a)
    tp = tp or tp_min
    replicas = n_devices // tp
    room = tp * a.usable_memory * dev.memory_bytes - model.weight_bytes
    cap = int(max(room, 0) // (context * model.kv_bytes_per_token))
    b = min(a.max_batch, cap) if batch is None else batch
    if tp < tp_min or replicas < 1 or n_devices % tp or b < 1 or b > cap:
        raise Infeasible(f"{dev.name} x{n_devices}: weights need {tp_min} devices per replica "
                         f"({tp} asked); KV room for {cap} requests of {context} tokens per replica")
    t_c = nonattn_time(model, dev, b, a.mfu, tp)
    t_a = attn_time(model, dev, b, context, tp, a.bw_efficiency)
    neck = "attention" if t_a >= t_c else _dense_kind(model, dev, b, tp, a.mfu)
    return Estimate(dev, n_devices, None, 0, context, b * replicas, t_c, t_a, 0.0, t_c + t_a, neck,
                    "KV capacity" if b == cap and b < a.max_batch else "max batch")


@dataclass(frozen=True)
class Ratio:
    """Memory devices needed per deployment for a workload, and why (each a device count)."""

    n_compute: int
    n_memory: int  # max of the three below
    for_capacity: int  # KV must fit
    for_bandwidth: int  # attention time <= dense time
    for_network: int  # memory-side NICs carry the transfers within the dense time
    t_compute: float  # s per step (dense part)

    @property
    def ratio(self) -> float:
        """Memory devices per compute device."""
        return self.n_memory / self.n_compute


def device_ratio(model: ModelSpec, compute: Device, memory: Device, batch: int, context: int,
                 n_compute: int | None = None, a: Assumptions = DEFAULT, tp: int | None = None) -> Ratio:
    """Fewest memory devices for ``batch`` requests of ``context`` tokens so that KV fits and
    neither attention nor memory-side network is slower than the dense part on
    ``n_compute`` devices (default: one replica of ``tp``, default :func:`tp_degree`)."""
    tp = tp or tp_degree(model, compute, a)
    n_compute = n_compute or tp
    t_c = _compute_period(model, compute, batch / (n_compute // tp), tp, a)
    up = lambda x: max(1, math.ceil(x - 1e-9))  # noqa: E731
    cap = up(batch * context * model.kv_bytes_per_token / (a.usable_memory * memory.memory_bytes))
    bw = up(attn_time(model, memory, batch, context, 1, a.bw_efficiency) / t_c)
    net = up(batch * model.transfer_bytes_per_token / (memory.nic_bw * t_c))
    return Ratio(n_compute, max(cap, bw, net), cap, bw, net, t_c)
