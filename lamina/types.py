"""Plain data shared across packages.

`memnode` and `computenode` never import each other; they meet through these dataclasses and
the wire protocol in `lamina.transport`. Everything here is plain data: no behaviour beyond
validation and trivial derived values.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

# KV formats a memory node's pool may hold (lamina.kernels.kv_format; ``auto``: the model's dtype)
KV_DTYPES = ("auto", "float32", "bfloat16", "int8", "fp8_e4m3", "k16v8")


@dataclass(frozen=True)
class AttentionSpec:
    """One attention operator of a split model.

    Semantics (shared by every kernel): a query at absolute position ``i`` sees a key at
    position ``j`` iff ``j <= i`` and, when ``window`` is set, ``i - j < window``. Scores are
    ``scale * q.k``; when ``softcap`` is set they become ``softcap * tanh(score / softcap)``
    before the softmax. Query head ``h`` uses KV head ``h // (num_heads // num_kv_heads)``.
    """

    layer: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    window: int | None = None
    softcap: float | None = None

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"layer {self.layer}: num_heads {self.num_heads} is not a multiple "
                             f"of num_kv_heads {self.num_kv_heads}")
        if self.window is not None and self.window <= 0:
            raise ValueError(f"layer {self.layer}: window must be positive, got {self.window}")

    @property
    def group_size(self) -> int:
        return self.num_heads // self.num_kv_heads


@dataclass(frozen=True)
class Segment:
    """The tokens one request contributes to one step: positions ``start_pos .. start_pos+num_tokens-1``."""

    req_id: int
    start_pos: int
    num_tokens: int


@dataclass
class StepPlan:
    """One iteration of one micro-batch.

    ``token_ids[T]`` and ``positions[T]`` (int64) are the segments' tokens flattened in segment
    order; ``sample_rows[R]`` (int64) indexes the rows of ``token_ids`` whose logits are sampled
    (the last token of each segment that completes its prompt or decodes).

    ``alone``: the engine had no other micro-batch in flight and none to form when it submitted
    this one, so its replica may wait in place for each layer's RESULT (a whole step in one C++
    call). False: another micro-batch is in flight or coming, whose slices run on this
    replica while this one's attention does (rotational pipelining), so none waits in place.
    """

    step_id: int
    micro_batch: int
    segments: list[Segment]
    token_ids: torch.Tensor
    positions: torch.Tensor
    sample_rows: torch.Tensor
    alone: bool = True

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])

    def sampled_positions(self) -> list[int]:
        """The position each sampled row's new token will take (its sampling key)."""
        return (self.positions[self.sample_rows] + 1).tolist()


# ---------------------------------------------------------------------------------------------
# Memory-node messages. Tensors are CPU or device tensors owned by the sender
# until the receiver returns; the receiver copies what it keeps.
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ShardWork:
    """One request's share of one step on one memory node.

    The node attends ``num_q`` new queries at positions ``q_start .. q_start+num_q-1`` over the
    part of the request it holds, after appending ``num_append`` new tokens' K/V at positions
    ``append_start ..`` (0 when another node stores them). Appended positions must extend the
    request's shard on this node contiguously, or open the node's first shard of the request.
    """

    req_id: int
    q_start: int
    num_q: int
    append_start: int = 0
    num_append: int = 0


@dataclass
class NodeRoute:
    """One node's share of a step: works for PREPARE, and the step rows it gets per layer."""

    node: int
    works: list[ShardWork]
    q_rows: torch.Tensor  # int64 (CPU) rows of the step's flattened tokens, in works order
    kv_rows: torch.Tensor  # int64 (CPU) rows whose k/v the node appends, in works order
    span: tuple[int, int] | None = field(init=False, default=None)  # (a, b): both rows == a..b-1

    def __post_init__(self) -> None:
        n = self.q_rows.numel()
        if n and n == self.kv_rows.numel():
            a = int(self.q_rows[0])
            run = torch.arange(a, a + n)
            if torch.equal(self.q_rows, run) and torch.equal(self.kv_rows, run):
                self.span = (a, a + n)

    def rows(self, t: torch.Tensor, kv: bool = False) -> torch.Tensor:
        """This node's rows of step tensor ``t`` (``kv``: its appended rows): a view when the
        rows are one run (:attr:`span`; ``t`` itself when that is all of ``t``), else a gather."""
        if self.span == (0, t.shape[0]):
            return t
        if self.span is not None:
            return t[self.span[0]:self.span[1]]
        return t[self.kv_rows if kv else self.q_rows]


@dataclass
class PrepareMsg:
    """PREPARE: this node's part of step ``step_id``; rows of ATTEND follow ``works`` order."""

    step_id: int
    works: list[ShardWork]


@dataclass
class AttendMsg:
    """ATTEND for one layer: ``q[Tq,H,D]`` for all works' queries, ``k/v[Ta,Hkv,D]`` for all appends,
    each concatenated in ``works`` order. ``reply_to`` names the replica that gets the result.

    ``works = (a, b)`` makes the message a mini-batch: only works ``[a, b)`` of the step's PREPARE,
    with their q and k/v rows. A layer's mini-batches go out in order and cover every work once;
    each gets its own RESULT (None: the whole step in one message)."""

    step_id: int
    layer: int
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    reply_to: int = 0
    works: tuple[int, int] | None = None


@dataclass
class AttendResult:
    """Partial attention ``o[Tq,H,D]`` (q's dtype) and ``lse[Tq,H]`` (float32, natural log) rows
    in ATTEND order; ``lse == -inf`` where a query sees no key on this node."""

    step_id: int
    layer: int
    o: torch.Tensor
    lse: torch.Tensor
    span_ns: tuple[int, int] | None = None  # node's ATTEND start/end, time.perf_counter_ns


@dataclass(frozen=True)
class NativeExchange:
    """A memory node's ATTEND that a whole-step program calls without Python
    (``lamina/csrc/exchange.h``: a plane in this process, a ring to a node's process): ``fn``
    the ``ExchangeFn`` capsule, ``obj`` the capsule of its ``self``; ``done()``, called once
    after a step that used it (a plane: end the steps whose last layer it attended; a ring:
    release the channel's locks); ``owner``: what ``obj`` points into, kept alive with it."""

    fn: Any
    obj: Any
    done: Callable[[], None]
    owner: Any = None


@dataclass
class KVChunk:
    """EXPORT's answer / IMPORT's payload: a request's K/V for positions
    ``start_pos .. start_pos+n-1`` over all layers, ``k/v[L,n,Hkv,D]`` as the exporting pool
    stores them, with ``k_scale``/``v_scale[L,n,Hkv]`` float32 for a part stored in 8 bits
    (:mod:`lamina.kernels.kv_format`; None otherwise)."""

    req_id: int
    start_pos: int
    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None


@dataclass
class NodeStats:
    """STATS: slot and slab accounting of one memory node."""

    capacity_slots: int
    used_slots: int
    free_slots: int
    slab_size: int
    total_slabs: int
    used_slabs: int
    free_slabs: int
    num_requests: int
    attend_us: int = 0  # cumulative time spent in ATTEND (store + kernel), microseconds
    shards: dict[int, tuple[int, int]] = field(default_factory=dict)  # req_id -> (start_pos, length)


@dataclass
class SamplingParams:
    """How to pick each next token of one request (vLLM-compatible names and defaults).

    ``temperature == 0`` is greedy. ``top_k <= 0`` and ``top_p == 1`` disable those filters.
    ``seed`` makes the request's samples reproducible regardless of what it is batched with.
    Generation stops at ``max_tokens`` new tokens, at EOS (unless ``ignore_eos``), at any of
    ``stop_token_ids``, or when the decoded text ends with one of ``stop`` (strings; the stop
    string is not included in the output text).
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    max_tokens: int = 16
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        def number(x) -> bool:
            return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)

        if not (number(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not (number(self.top_p) and 0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < -1:
            raise ValueError(f"top_k must be an int >= -1 (0 or -1 disables), got {self.top_k!r}")
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) \
                or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise ValueError(f"seed must be an int or None, got {self.seed!r}")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative ints, got {self.stop_token_ids!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop must be non-empty strings, got {self.stop!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
