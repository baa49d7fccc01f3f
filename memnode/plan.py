"""Per-step kernel indices: what PREPARE precomputes so each ATTEND is one kernel call per layer.

For a step with works ``w_0 .. w_{R-1}`` (one per request, in plan order) the node holds, after
the step's appends, request r's keys at positions ``[ks_r, ke_r)`` in slots ``slots_r``. Its
queries are positions ``[qs_r, qe_r)``. The kernel sees (CSR form):

* ``qo_indptr[R+1]``: cumulative ``num_q``; ``q_positions[Tq]``: absolute query positions.
* per distinct sliding window ``w`` of the model's layers, ``kv_indptr[R+1]``,
  ``kv_indices[N]``, ``kv_start_pos[R]``: the keys of each request that *some* query of the step
  can see, i.e. positions ``[max(ks, qs - w + 1), min(ke, qe))`` (no lower bound without a
  window). Trimming keys no query can see is exact: the kernel masks them anyway.

The two index pointers stay on the host (numpy; the kernels take them as host tensors, and
Triton plans from them without waiting for the GPU); every other array is int64 on the pool's
device. All are built once per step (numpy, no per-slot loops).

An ATTEND may carry a *mini-batch*: works ``[a, b)`` of the step (communication-attention
overlap, Lamina §5.2.1). :meth:`StepState.view` slices the CSR arrays to those works using the
host index pointers (no device sync).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from lamina.memnode.cascade import Cascade, shared_prefixes
from lamina.memnode.shard import Shard
from lamina.types import ShardWork

__all__ = ["KernelIndex", "StepState", "StepView", "build_step"]


@dataclass
class KernelIndex:
    """Key side of the CSR arrays for the layers sharing one window."""

    kv_indptr: np.ndarray  # int64 [R+1], on the host
    kv_indices: torch.Tensor  # int64 [N]
    kv_start_pos: torch.Tensor  # int64 [R]

    def view(self, a: int, b: int) -> "KernelIndex":
        ka, kb = int(self.kv_indptr[a]), int(self.kv_indptr[b])
        return KernelIndex(self.kv_indptr[a: b + 1] - ka, self.kv_indices[ka:kb],
                           self.kv_start_pos[a:b])


@dataclass
class StepView:
    """The kernel inputs for works ``[a, b)`` of a step (all of them by default)."""

    qo_indptr: np.ndarray  # int64 [b-a+1], on the host
    q_positions: torch.Tensor  # int64 [Tq']
    append_slots: torch.Tensor  # int64 [Ta']
    kv: dict[int | None, KernelIndex]

    @property
    def num_q(self) -> int:
        return int(self.q_positions.numel())

    @property
    def num_append(self) -> int:
        return int(self.append_slots.numel())


@dataclass
class StepState:
    """One prepared step (micro-batch iteration) on one node, alive until its last layer."""

    step_id: int
    works: list[ShardWork]
    shards: list[Shard]  # the shard of each work, same order (after the appends)
    q_positions: torch.Tensor  # int64 [Tq]
    append_slots: torch.Tensor  # int64 [Ta]: slots of the appended rows of ATTEND's k/v
    kv: dict[int | None, KernelIndex]  # window -> key indices
    q_indptr: np.ndarray  # host: cumulative num_q and num_append per work, [R+1]
    a_indptr: np.ndarray
    # host int64 [L + 1]: [i] the first work of pool layer i not attended yet (-1: all were),
    # [L] the layers left; moved by MemoryNode.attend and by the native plane alike
    progress: np.ndarray
    deferred_free: list[np.ndarray] = field(default_factory=list)  # slots freed while in flight
    cascade: Cascade | None = None  # shared prefixes read once (whole-step ATTENDs, no window)

    def view(self, a: int, b: int) -> StepView:
        """Kernel inputs for works ``[a, b)``; ``0 <= a < b <= R`` (or the whole step)."""
        if (a, b) == (0, len(self.works)):
            return StepView(self.q_indptr, self.q_positions, self.append_slots, self.kv)
        qa, qb = int(self.q_indptr[a]), int(self.q_indptr[b])
        aa, ab = int(self.a_indptr[a]), int(self.a_indptr[b])
        return StepView(self.q_indptr[a: b + 1] - qa, self.q_positions[qa:qb],
                        self.append_slots[aa:ab], {w: i.view(a, b) for w, i in self.kv.items()})


def _piece(old: np.ndarray, new: np.ndarray, a: int, b: int) -> list[np.ndarray]:
    """Slots at offsets ``[a, b)`` of the virtual concatenation ``old ++ new`` (views)."""
    n_old = old.size
    out = []
    if a < n_old:
        out.append(old[a: min(b, n_old)])
    if b > n_old:
        out.append(new[max(a - n_old, 0): b - n_old])
    return out


def build_step(step_id: int, works: list[ShardWork], shards: list[Shard | None],
               new_slots: list[np.ndarray], windows: set[int | None], num_layers: int,
               device: torch.device) -> StepState:
    """Kernel indices for ``works`` without touching the shards.

    ``shards[r]`` is request r's shard before the step (None when the step opens it at
    ``works[r].append_start``), ``new_slots[r]`` the slots allocated for its appended tokens.
    The returned state's ``shards`` list is left empty for the caller to fill at commit.
    """
    R = len(works)
    num_q = np.fromiter((w.num_q for w in works), dtype=np.int64, count=R)
    q_start = np.fromiter((w.q_start for w in works), dtype=np.int64, count=R)
    qo_indptr = np.zeros(R + 1, dtype=np.int64)
    np.cumsum(num_q, out=qo_indptr[1:])
    # position of row t of request r is q_start[r] + (t - qo_indptr[r])
    q_positions = (np.repeat(q_start - qo_indptr[:-1], num_q)
                   + np.arange(qo_indptr[-1], dtype=np.int64))
    empty = np.zeros(0, dtype=np.int64)
    olds = [sh.slots if sh is not None else empty for sh in shards]
    ks = np.fromiter((sh.start if sh is not None else w.append_start
                      for sh, w in zip(shards, works)), dtype=np.int64, count=R)
    ke = ks + np.fromiter((o.size + n.size for o, n in zip(olds, new_slots)), dtype=np.int64,
                          count=R)
    qe = q_start + num_q

    def to_dev(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a)).to(device)

    def index(lo: np.ndarray) -> KernelIndex:  # keys [lo, min(ke, qe)) of each work
        count = np.where(num_q > 0, np.maximum(np.minimum(ke, qe) - lo, 0), 0)
        lo = np.where(count > 0, lo, ks)
        pieces: list[np.ndarray] = []
        for r in range(R):
            if count[r]:
                a = int(lo[r] - ks[r])
                pieces += _piece(olds[r], new_slots[r], a, a + int(count[r]))
        kv_indptr = np.zeros(R + 1, dtype=np.int64)
        np.cumsum(count, out=kv_indptr[1:])
        indices = np.concatenate(pieces) if pieces else empty
        return KernelIndex(kv_indptr, to_dev(indices), to_dev(lo))

    kv = {w: index(ks if w is None else np.maximum(ks, q_start - w + 1)) for w in windows}
    cascade = None
    groups = shared_prefixes(olds, ks, q_start, num_q) if None in windows else []
    if groups:
        lo = ks.copy()
        for members, p in groups:
            lo[members] = p
        rows = [np.arange(qo_indptr[r], qo_indptr[r + 1]) for members, _ in groups
                for r in members]
        g_q = np.zeros(len(groups) + 1, dtype=np.int64)
        np.cumsum([int(num_q[members].sum()) for members, _ in groups], out=g_q[1:])
        g_kv = np.zeros(len(groups) + 1, dtype=np.int64)
        np.cumsum([p for _, p in groups], out=g_kv[1:])
        rows_np = np.concatenate(rows)
        cascade = Cascade(index(lo), to_dev(rows_np), g_q, to_dev(q_positions[rows_np]),
                          KernelIndex(g_kv, to_dev(np.concatenate(
                              [olds[m[0]][:p] for m, p in groups])),
                              to_dev(np.zeros(len(groups), dtype=np.int64))))
    append = np.concatenate(new_slots) if new_slots else empty
    a_indptr = np.zeros(R + 1, dtype=np.int64)
    np.cumsum([n.size for n in new_slots], out=a_indptr[1:])
    progress = np.zeros(num_layers + 1, dtype=np.int64)
    progress[-1] = num_layers
    return StepState(step_id=step_id, works=list(works), shards=[],
                     q_positions=to_dev(q_positions), append_slots=to_dev(append), kv=kv,
                     q_indptr=qo_indptr, a_indptr=a_indptr, progress=progress, cascade=cascade)
