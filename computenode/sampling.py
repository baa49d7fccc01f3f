"""Next-token sampling: greedy, temperature, top-k and top-p (nucleus), seeded per request.

Target distribution of one non-greedy row (``temperature > 0``), as computed by
:func:`filtered_probs`:

1. ``z = logits.float() / temperature`` (float32 whatever the logits' dtype);
2. top-k (``0 < top_k < V``): tokens whose float32 logit is below the ``top_k``-th largest
   get ``-inf``. Ties at the boundary are all kept, so more than ``top_k`` tokens may survive;
3. ``p = softmax(z)`` over the survivors;
4. top-p (``top_p < 1``): sort ``p`` in descending order and keep the shortest prefix whose
   cumulative probability is ``>= top_p`` (the top token is always kept). Every token whose
   probability equals the smallest kept probability is kept as well (ties are kept, as in
   top-k), all others become 0;
5. renormalise.

``temperature == 0`` is greedy: ``argmax`` of the raw logits (ties go to the lowest index).
``top_k <= 0`` or ``top_k >= V`` and ``top_p == 1`` disable those filters.

Randomness. A non-greedy sample of a request consumes one uniform in ``[0, 1)`` (24 bits,
exact in float32): a counter-based draw (SplitMix64's mixer) of the request's seed and a key,
the position in the sequence of the token being sampled where the caller gives it (the engine
always does), else the number of the request's draws so far. The seed is
``SamplingParams.seed`` when given, else one drawn from the sampler's own RNG (OS entropy, or
the ``seed`` given to the sampler). So a seeded request gets the same tokens whatever it is
batched with and in whichever row it sits, as long as its own logits are the same; and since
the key is the token's position, also after its KV was recomputed (a preemption, a restarted
memory node or instance): a step dropped in flight leaves no trace in what the request draws
next. Greedy samples consume no randomness.

The draw is an inverse-CDF lookup done batched on the logits' device: ``u * total`` is located
in the row's cumulative (unnormalised) filtered weights. Only the ``R`` uniforms travel to the
device and only the ``R`` token ids travel back. Filtered-out tokens (weight 0) can never be
drawn, even under float rounding.
"""
from __future__ import annotations

import math
import numbers
import random
from collections.abc import Sequence

import torch

from lamina.types import SamplingParams

__all__ = ["Sampler", "filtered_probs"]

_MASK = (1 << 64) - 1


def uniform(seed: int, key: int) -> float:
    """The uniform in ``[0, 1)`` (a multiple of 2**-24, so exact in float32) of draw ``key`` of
    a request seeded ``seed``: SplitMix64's output function over ``seed + (key + 1) * golden``
    (consecutive keys of one seed, and the same key of nearby seeds, look independent)."""
    z = (seed + (key + 1) * 0x9E3779B97F4A7C15) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return ((z ^ (z >> 31)) >> 40) * 2.0 ** -24


def _per_row(value, n: int, name: str) -> list:
    """``value`` (scalar, sequence or 1-D tensor) as a list of ``n`` Python numbers."""
    if isinstance(value, torch.Tensor):
        value = value.reshape(-1).tolist() if value.dim() > 0 else value.item()
    if isinstance(value, numbers.Real):
        return [value] * n
    values = list(value)
    if len(values) != n:
        raise ValueError(f"{name}: expected one value per row ({n}), got {len(values)}")
    return values


def _check_params(temps: list, top_ks: list, top_ps: list) -> None:
    if all(type(t) is float and 0 <= t < math.inf for t in temps) and \
            all(type(k) is int and k >= -1 for k in top_ks) and \
            all(type(p) is float and 0 < p <= 1 for p in top_ps):
        return  # fast path for the common case; the loops below name the offending value
    for t in temps:
        if not (isinstance(t, numbers.Real) and math.isfinite(t) and t >= 0):
            raise ValueError(f"temperature must be a finite number >= 0, got {t!r}")
    for k in top_ks:
        if not (isinstance(k, numbers.Integral) and k >= -1):
            raise ValueError(f"top_k must be an int >= -1, got {k!r}")
    for p in top_ps:
        if not (isinstance(p, numbers.Real) and 0 < p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {p!r}")


@torch.no_grad()
def filtered_probs(logits: torch.Tensor, temperature: float | Sequence[float] | torch.Tensor,
                   top_k: int | Sequence[int] | torch.Tensor = 0,
                   top_p: float | Sequence[float] | torch.Tensor = 1.0, *,
                   normalize: bool = True) -> torch.Tensor:
    """The sampling distribution of ``logits`` (``[V]`` or ``[R, V]``, any float dtype/device).

    ``temperature``, ``top_k`` and ``top_p`` are scalars (shared by all rows) or one value per
    row. Returns float32 probabilities with the shape and device of ``logits``; see the module
    docstring for the exact definition. Rows with ``temperature == 0`` are one-hot at the
    argmax. With ``normalize=False`` the rows are left unnormalised (the largest surviving
    weight of a non-greedy row is 1); :class:`Sampler` uses that form, which avoids a division
    that could make a row's bits depend on the filters of other rows.

    Preconditions: every row has at least one finite logit, none is ``nan`` or ``+inf``
    (``-inf`` marks banned tokens). Raises ``ValueError`` on a bad shape or parameter. Pure: the
    input is not modified.
    """
    if logits.dim() not in (1, 2) or not logits.is_floating_point():
        raise ValueError(f"logits must be a float tensor [V] or [R, V], got {tuple(logits.shape)} "
                         f"{logits.dtype}")
    single = logits.dim() == 1
    x = logits.unsqueeze(0) if single else logits
    rows, vocab = x.shape
    temps = _per_row(temperature, rows, "temperature")
    top_ks = _per_row(top_k, rows, "top_k")
    top_ps = _per_row(top_p, rows, "top_p")
    _check_params(temps, top_ks, top_ps)
    if rows == 0 or vocab == 0:
        return torch.zeros(x.shape, dtype=torch.float32, device=x.device).reshape(logits.shape)
    dev = x.device

    x = x.float()
    # Shift so that each row's max is 0: exp() then never overflows and needs no softmax sum.
    t = torch.tensor([t if t > 0 else 1.0 for t in temps], dtype=torch.float32, device=dev)
    z = (x - x.amax(dim=1, keepdim=True)) / t.unsqueeze(1)

    ks = [k if 0 < k < vocab else 0 for k in top_ks]
    kmax = max(ks)
    if kmax > 0:
        # Ranked on the float32 logits themselves: the shift and the division could round
        # distinct logits into ties.
        top = torch.topk(x, kmax, dim=1, largest=True, sorted=True).values
        kth = top.gather(1, torch.tensor([max(k, 1) - 1 for k in ks], device=dev).unsqueeze(1))
        active = torch.tensor([k > 0 for k in ks], device=dev).unsqueeze(1)
        kth = torch.where(active, kth, torch.full_like(kth, -math.inf))
        z = z.masked_fill(x < kth, -math.inf)
    w = torch.exp(z)  # unnormalised softmax; the top token has weight exactly 1

    if any(p < 1 for p in top_ps):
        sw = torch.sort(w, dim=1, descending=True).values
        cum = sw.cumsum(dim=1)
        before = torch.cat([torch.zeros_like(cum[:, :1]), cum[:, :-1]], dim=1)  # mass of higher ranks
        p = torch.tensor([float(p) for p in top_ps], dtype=torch.float32, device=dev).unsqueeze(1)
        # Rank i is kept iff the ranks above it hold less than top_p of the mass.
        keep = (before < p * cum[:, -1:]) & (sw > 0)
        n_keep = keep.sum(dim=1, keepdim=True).clamp_min(1)
        cut = sw.gather(1, n_keep - 1)
        cut = torch.where(p < 1, cut, torch.zeros_like(cut))
        w = w.masked_fill(w < cut, 0.0)

    greedy = [i for i, t in enumerate(temps) if t == 0]
    if greedy:
        gi = torch.tensor(greedy, device=dev)
        hot = torch.zeros(len(greedy), vocab, dtype=torch.float32, device=dev)
        hot.scatter_(1, x.index_select(0, gi).argmax(dim=1, keepdim=True), 1.0)
        w = w.index_copy(0, gi, hot)
    if normalize:
        w = w / w.sum(dim=1, keepdim=True)
    return w.squeeze(0) if single else w


def _inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Row-wise draw from unnormalised ``weights[R, V]`` (>= 0, each row > 0 somewhere) given
    uniforms ``u[R]`` in ``[0, 1)``: the first token whose cumulative weight exceeds
    ``u * total``. Zero-weight tokens are never returned."""
    cdf = weights.cumsum(dim=1)
    # Zero-weight entries copy the previous value (and leading ones are -inf), and cummax makes
    # the CDF monotone even if a parallel scan rounds unevenly, so a zero-weight token is never
    # the first entry to exceed the target.
    cdf = torch.cummax(cdf.masked_fill(weights <= 0, -math.inf), dim=1).values
    target = u.unsqueeze(1) * cdf[:, -1:]
    # Index of the first entry > target (the CDF is monotone, so a count suffices; it is also
    # cheaper than a batched searchsorted for small rows and trivially parallel for long ones).
    idx = (cdf <= target).sum(dim=1)
    # If rounding put the target at or past the total, the count is V; fall back to the first
    # token where the CDF reaches its maximum (a token with positive weight).
    return torch.minimum(idx, cdf.argmax(dim=1))


class Sampler:
    """Picks one token per row of a logits batch; each request draws from its own seed.

    Contracts:

    * ``sample(logits[R, V], req_ids, params)`` returns ``int64[R]`` on CPU. ``logits`` may have
      any float dtype and live on any device; it is not modified.
    * A request's seed is fixed at its first non-greedy draw and kept until :meth:`release`
      (with its draw count). Its parameters (in particular ``seed``) are read only then.
    * Without keys, rows with the same ``req_id`` in one call draw in row order.
    * Not thread-safe.
    """

    def __init__(self, seed: int | None = None) -> None:
        """``seed`` seeds the RNG that seeds requests without their own ``seed``; ``None`` uses
        OS entropy (unseeded requests are then not reproducible)."""
        self._seeder = random.Random(seed)
        self._seeds: dict[int, int] = {}  # req_id -> its seed
        self._draws: dict[int, int] = {}  # req_id -> draws so far without a key

    @property
    def num_requests(self) -> int:
        """How many requests currently hold a seed."""
        return len(self._seeds)

    def __contains__(self, req_id: int) -> bool:
        return req_id in self._seeds

    def release(self, req_id: int) -> None:
        """Forget a finished request's seed and draw count (no-op when it has none). A later
        sample with the same ``req_id`` starts again from its seed."""
        self._seeds.pop(req_id, None)
        self._draws.pop(req_id, None)

    def _seed(self, req_id: int, params: SamplingParams) -> int:
        seed = self._seeds.get(req_id)
        if seed is None:
            seed = params.seed if params.seed is not None else self._seeder.getrandbits(64)
            seed = self._seeds[req_id] = seed & _MASK
        return seed

    def _key(self, req_id: int) -> int:
        n = self._draws.get(req_id, 0)
        self._draws[req_id] = n + 1
        return n

    @torch.no_grad()
    def sample(self, logits: torch.Tensor, req_ids: Sequence[int],
               params: Sequence[SamplingParams],
               uniforms: torch.Tensor | None = None) -> torch.Tensor:
        """One token per row: argmax for greedy rows, a draw from :func:`filtered_probs` with the
        request's next uniform (:meth:`draw` without keys) for the others, or with
        ``uniforms[R]`` when given (then this sampler's state is not touched). Raises
        ``ValueError`` on mismatched lengths, a non-2-D or non-float ``logits``, or invalid
        parameters (checked before anything is drawn)."""
        if logits.dim() != 2 or not logits.is_floating_point():
            raise ValueError(f"logits must be a float tensor [R, V], got {tuple(logits.shape)} "
                             f"{logits.dtype}")
        rows = logits.shape[0]
        if len(req_ids) != rows or len(params) != rows:
            raise ValueError(f"{rows} logit rows but {len(req_ids)} req_ids and "
                             f"{len(params)} params")
        if rows == 0:
            return torch.empty(0, dtype=torch.int64)
        if logits.shape[1] == 0:
            raise ValueError("empty vocabulary")
        drawn = [i for i, p in enumerate(params) if p.temperature != 0]
        if not drawn:
            return logits.argmax(dim=1).cpu()
        dev = logits.device
        out = torch.empty(rows, dtype=torch.int64, device=dev)
        if len(drawn) < rows:
            gi = torch.tensor([i for i, p in enumerate(params) if p.temperature == 0], device=dev)
            out.index_copy_(0, gi, logits.index_select(0, gi).argmax(dim=1))

        ri = torch.tensor(drawn, device=dev)
        sub = [params[i] for i in drawn]
        weights = filtered_probs(logits.index_select(0, ri), [p.temperature for p in sub],
                                 [p.top_k for p in sub], [p.top_p for p in sub], normalize=False)
        if uniforms is None:
            uniforms = self.draw(req_ids, params)
        elif uniforms.shape != (rows,):
            raise ValueError(f"uniforms must have one value per row ({rows}), got "
                             f"{tuple(uniforms.shape)}")
        u = uniforms.to(torch.float32)[drawn]
        out.index_copy_(0, ri, _inverse_cdf(weights, u.to(dev)))
        return out.cpu()

    def draw(self, req_ids: Sequence[int], params: Sequence[SamplingParams],
             keys: Sequence[int] | None = None) -> torch.Tensor:
        """``float32[R]``: the uniform of each non-greedy row (0 for greedy rows, which consume
        none): draw ``keys[i]`` of its request (the position of the token it samples), or
        without ``keys`` the request's next draw, in row order. Drawing here and passing the
        result to :meth:`sample` of another Sampler (a replica in another process) samples
        exactly as this Sampler would."""
        if keys is not None and len(keys) != len(req_ids):
            raise ValueError(f"{len(req_ids)} rows but {len(keys)} keys")
        return torch.tensor([uniform(self._seed(r, p), self._key(r) if keys is None else k)
                             if p.temperature != 0 else 0.0
                             for r, p, k in zip(req_ids, params, keys or req_ids)],
                            dtype=torch.float32)
