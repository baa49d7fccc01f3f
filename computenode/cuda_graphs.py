"""CUDA graphs for the dense slices: one graph per (slice, padded token count), replayed at decode.

At small batches a decode slice is a few dozen tiny kernels whose launch cost, not their work,
sets the step time. :class:`SliceGraphs` captures every slice of a split model once per size
of :func:`capture_sizes` (as vLLM does: 1, 2, 4, then multiples of 8 up to the replica's
largest batch) and replays the smallest graph that holds a step:

* a step of ``T`` tokens and ``R`` sample rows (``R <= T``) runs on the graph of the smallest
  captured ``Tp >= T``; inputs are copied into the graph's static buffers, their padding rows
  zeroed (token id 0, position 0, sample row 0, zero activations: valid values whose outputs
  are cut away), and each output is cut back to ``T`` (or ``R``) rows and cloned, because the
  next replay of that graph overwrites it (micro-batches in flight keep their contexts);
* a step larger than every captured size (a prefill chunk) runs the eager slice.

Which dimension of each input and output carries the tokens is found once, by running the
slices eagerly at two probe sizes (5 tokens/3 rows, 6 tokens/4 rows) and comparing shapes: a
dimension that changes is a token dimension (``T``) or a sample-row dimension (``R``) by its
size in the first probe. Shapes that no probe changes are fixed by the model.

Contract: inputs are the tensors :meth:`SplitModel.run_slice` passes (on the graphs' device);
outputs are fresh tensors owned by the caller. The replay backend is ``torch.cuda.CUDAGraph``
on a CUDA device; :class:`EagerGraph` (the same static-buffer semantics, run eagerly) lets the
padding and ownership logic be tested on CPU. Graphs are never used silently on a device that
cannot capture them: :func:`unavailable` says why and :class:`SliceGraphs` raises with it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from lamina.splitter import SplitModel

PROBES = ((5, 3), (6, 4))  # (tokens, sample rows) of the two probe runs; distinct sizes


def capture_sizes(max_tokens: int) -> tuple[int, ...]:
    """Token counts to capture for steps of up to ``max_tokens`` tokens: 1, 2, 4, 8, 16, 24,
    ... (multiples of 8), and ``max_tokens`` itself."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    sizes = {s for s in (1, 2, 4) if s <= max_tokens} | set(range(8, max_tokens + 1, 8)) | {max_tokens}
    return tuple(sorted(sizes))


def unavailable(device: torch.device) -> str | None:
    """Why CUDA graphs cannot be captured on ``device`` (None: they can)."""
    if device.type != "cuda":
        return f"CUDA graphs need a CUDA compute device; the replica runs on {device}"
    if not torch.cuda.is_available():
        return "CUDA graphs need a CUDA GPU; torch.cuda.is_available() is False"
    return None


class EagerGraph:
    """CPU stand-in for ``torch.cuda.CUDAGraph`` with its buffer semantics: :meth:`capture`
    records ``fn`` over static inputs and returns static outputs; :meth:`replay` reruns it and
    writes the results into those same output tensors."""

    def capture(self, fn: Callable, inputs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        self.fn, self.inputs = fn, list(inputs)
        self.outputs = tuple(fn(*self.inputs))
        return self.outputs

    def replay(self) -> None:
        for static, new in zip(self.outputs, self.fn(*self.inputs)):
            static.copy_(new)


class CudaGraph:
    """One ``torch.cuda.CUDAGraph`` of ``fn`` over static inputs, warmed up on a side stream
    and captured into the memory pool shared by every graph of one :class:`SliceGraphs`."""

    def __init__(self, pool) -> None:
        self.pool = pool
        self.graph = torch.cuda.CUDAGraph()

    def capture(self, fn: Callable, inputs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):  # lazy init (cuBLAS handles, autotuning) outside the capture
                fn(*inputs)
        torch.cuda.current_stream().wait_stream(side)
        with torch.cuda.graph(self.graph, pool=self.pool):
            outputs = tuple(fn(*inputs))
        return outputs

    def replay(self) -> None:
        self.graph.replay()


@dataclass
class _Captured:
    """One slice at one padded size: the graph, its static inputs and outputs."""

    graph: EagerGraph | CudaGraph
    inputs: list[torch.Tensor]
    outputs: tuple[torch.Tensor, ...]


Dims = list[tuple[int, str] | None]  # per tensor: (dimension, "T" or "R"), or None if fixed


class SliceGraphs:
    """Captured graphs of every slice of ``split`` for the token counts ``sizes`` on
    ``device`` (module docstring). Call it as ``graphs(k, args) -> outputs`` where
    :meth:`SplitModel.run_slice` would call ``split.slices[k](*args)``. ``eager=True`` uses
    :class:`EagerGraph` (tests); otherwise the device must be able to capture CUDA graphs."""

    def __init__(self, split: SplitModel, device: torch.device | str, sizes: Sequence[int],
                 eager: bool = False) -> None:
        self.split = split
        self.device = torch.device(device)
        if not eager and (why := unavailable(self.device)) is not None:
            raise RuntimeError(why)
        self.sizes = tuple(sorted(set(sizes)))
        self.eager = eager
        self.replays = 0  # steps served by a graph (for reports and tests)
        self.in_dims, self.out_dims = self._probe()
        self.pool = None if eager else torch.cuda.graph_pool_handle()
        self.graphs: dict[tuple[int, int], _Captured] = {}
        with torch.inference_mode():
            for size in reversed(self.sizes):  # largest first: later graphs reuse its pool
                self._capture_all(size)

    # -- setup ---------------------------------------------------------------------------------
    def _chain(self, tokens: int, rows: int, each: Callable[[int, list], tuple] | None = None):
        """Run every slice (through :meth:`SplitModel.forward`, zero attention in between) on
        ``tokens`` dummy tokens with ``rows`` sample rows; ``each(k, args)`` (default: the eager
        slice) computes slice k. Returns ``[(args, outputs)]`` per slice."""
        run = each or (lambda k, args: tuple(self.split.slices[k](*args)))
        seen = []

        def record(k: int, args: list) -> tuple:
            seen.append((args, run(k, args)))
            return seen[-1][1]

        dev = self.device
        self.split.forward(torch.zeros(tokens, dtype=torch.long, device=dev), torch.arange(tokens, device=dev),
                           torch.arange(tokens - rows, tokens, device=dev),
                           lambda k, q, kk, v: torch.zeros(q.shape, dtype=q.dtype, device=dev), record)
        return seen

    def _probe(self) -> tuple[list[Dims], list[Dims]]:
        with torch.inference_mode():
            a, b = (self._chain(t, r) for t, r in PROBES)
        (ta, ra) = PROBES[0]

        def dims(xs: Sequence[torch.Tensor], ys: Sequence[torch.Tensor]) -> Dims:
            found: Dims = []
            for x, y in zip(xs, ys):
                changed = [d for d in range(x.dim()) if x.shape[d] != y.shape[d]]
                if len(changed) > 1 or (changed and x.shape[changed[0]] not in (ta, ra)):
                    raise ValueError(f"cannot graph a slice value of shape {tuple(x.shape)}: "
                                     "more than one dimension follows the batch")
                found.append((changed[0], "T" if x.shape[changed[0]] == ta else "R") if changed else None)
            return found

        return ([dims(xa[0], xb[0]) for xa, xb in zip(a, b)],
                [dims(xa[1], xb[1]) for xa, xb in zip(a, b)])

    def _capture_all(self, size: int) -> None:
        def capture(k: int, args: list) -> tuple:
            static = [t.clone() for t in args]
            graph = EagerGraph() if self.eager else CudaGraph(self.pool)
            outputs = graph.capture(self.split.slices[k], static)
            self.graphs[(k, size)] = _Captured(graph, static, outputs)
            return outputs

        self._chain(size, size, capture)

    # -- replay --------------------------------------------------------------------------------
    def size_for(self, k: int, args: Sequence[torch.Tensor]) -> int | None:
        """The captured size that runs slice ``k`` on ``args``, or None (run it eagerly)."""
        need = max((t.shape[d[0]] for t, d in zip(args, self.in_dims[k]) if d is not None), default=0)
        return next((s for s in self.sizes if s >= need), None)

    def __call__(self, k: int, args: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        size = self.size_for(k, args)
        if size is None:
            return tuple(self.split.slices[k](*args))
        cap = self.graphs[(k, size)]
        counts = {"T": 0, "R": 0}
        for static, new, d in zip(cap.inputs, args, self.in_dims[k]):
            if d is None:
                static.copy_(new)
                continue
            n = new.shape[d[0]]
            counts[d[1]] = n
            static.narrow(d[0], 0, n).copy_(new)
            if n < size:
                static.narrow(d[0], n, size - n).zero_()
        cap.graph.replay()
        self.replays += 1
        return tuple(out.clone() if d is None else out.narrow(d[0], 0, counts[d[1]]).clone()
                     for out, d in zip(cap.outputs, self.out_dims[k]))
