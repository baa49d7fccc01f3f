"""A device-driven decode step: one CUDA graph per padded size and micro-batch slot holds every
dense slice of the step with its sends and waits (issue 41, item 3; Lamina §5.3).

Inside the graph each layer's q/k/v are copied into the slot's section of the step mailbox
(:mod:`lamina.transport.mailbox`: host memory mapped into the GPU), a one-thread kernel moves
its SEND word, and one wait kernel per memory node holds the stream until that node's REPLY
reaches the same value (bounded: past ``WAIT_TIMEOUT_S`` it marks MISSED and lets the stream
go); the nodes' outputs are then merged by LSE on the device and the next slice runs. Flag
values cannot be baked into a graph that replays every step, so the kernels add the layer's
offset to the step's BASE word, which the host writes with the rest of the step's header
(:meth:`Mailbox.post`) before it launches the graph. The host launches one graph per
micro-batch per step, then samples; no host code runs per layer on the compute side.

Memory nodes answer from their own loop (:class:`~lamina.transport.mailbox.MailboxServer`).
For nodes in the engine's process, the launching thread runs their loop until the graph is
done (``serve``); a node in a process of its own runs it on a thread there
(:mod:`lamina.memnode.mailbox_loop`) over a mailbox the replica's process shares
(:mod:`lamina.computenode.remote_steps`). A step the graphs cannot hold (more tokens than the
largest size, a route to a node the mailbox does not know) runs the slice-by-slice path.

Capability: the CUDA path needs cupy and host memory the GPU can map
(:func:`lamina.computenode.device_wait.unavailable`); :class:`HostFlags` with
``eager=True`` is its CPU stand-in (the step's calls made again at every replay over the same
mailbox, headers and merge; a wait serves the nodes in place), so the protocol runs in CI. The CUDA
path is tested under ``pytest -m gpu`` (``tests/computenode/test_step_graphs.py``).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from lamina.splitter import SplitModel
from lamina.transport.mailbox import (BASE, MISSED, REPLY, SEND, Mailbox, MailboxServer,
                                      MailboxShape, host_buffer)
from lamina.transport.ring_memory import fence
from lamina.types import NodeRoute, StepPlan

WAIT_TIMEOUT_S = 60.0  # as device_wait's: a node silent for a minute is gone


class HostFlags:
    """The mailbox's SEND and waits from the host (CPU stand-in): :meth:`wait` runs ``serve``
    (the nodes' pollers; returns whether it answered anything) until the node's REPLY
    arrives, at most ``timeout_s`` (then MISSED, as the device wait does)."""

    def __init__(self, box: Mailbox, serve: Callable[[], bool],
                 timeout_s: float = WAIT_TIMEOUT_S) -> None:
        self.box, self.serve, self.timeout_s = box, serve, timeout_s

    def signal(self, slot: int, offset: int) -> None:
        words = self.box.words(slot)
        fence()
        words[SEND] = int(words[BASE]) + offset

    def wait(self, slot: int, node: int, offset: int) -> None:
        words, reply = self.box.words(slot), self.box.node_words(slot, node)
        target = int(words[BASE]) + offset
        deadline = time.monotonic() + self.timeout_s
        while int(reply[REPLY]) < target:
            if not self.serve():
                if time.monotonic() > deadline:
                    words[MISSED] = 1
                    return
                time.sleep(0)  # the answer comes from elsewhere: let it run
        fence()


class CudaFlags:
    """The same on the GPU: kernels enqueued (or captured) on the current CUDA stream, over
    ``box`` (a :class:`Mailbox` on a CUDA alias of mapped host memory)."""

    def __init__(self, box: Mailbox, timeout_s: float = WAIT_TIMEOUT_S) -> None:
        from lamina.computenode.device_wait import mailbox_kernel

        self.box, self.timeout_ns = box, int(timeout_s * 1e9)
        self._signal = mailbox_kernel("lamina_signal_word")
        self._wait = mailbox_kernel("lamina_wait_word")
        # compile and load both before any capture (slot 0 is idle: SEND = REPLY = BASE = 0)
        self.signal(0, 0)
        self.wait(0, 0, 0)
        torch.cuda.current_stream().synchronize()

    def signal(self, slot: int, offset: int) -> None:
        from lamina.computenode.device_wait import launch_on

        words = self.box.words(slot)
        launch_on(torch.cuda.current_stream(), self._signal,
                  (_addr(words, SEND), _addr(words, BASE), offset))

    def wait(self, slot: int, node: int, offset: int) -> None:
        from lamina.computenode.device_wait import launch_on

        words, reply = self.box.words(slot), self.box.node_words(slot, node)
        launch_on(torch.cuda.current_stream(), self._wait,
                  (_addr(reply, REPLY), _addr(words, BASE), offset, self.timeout_ns,
                   _addr(words, MISSED)))


def _addr(words: torch.Tensor, i: int) -> int:
    return words.data_ptr() + 8 * i


def merge(os: list[torch.Tensor], lses: list[torch.Tensor]) -> torch.Tensor:
    """The nodes' outputs ``o[T, H, D]`` merged by their ``lse[T, H]`` (a row no node saw: 0);
    one node's output is returned as it is (copied out of the mailbox)."""
    if len(os) == 1:
        return os[0].clone()
    lse = torch.stack(lses)
    top = lse.amax(0)
    w = torch.exp(lse - torch.where(torch.isfinite(top), top, torch.zeros_like(top)))
    num = sum(w[n].unsqueeze(-1) * os[n].float() for n in range(len(os)))
    den = w.sum(0).unsqueeze(-1)
    return torch.where(den > 0, num / den.clamp_min(1e-30), 0.0).to(os[0].dtype)


@dataclass
class _Step:
    """One slot's step at one padded size: its static inputs and, captured, the graph and its
    logits; or (the CPU stand-in) the calls to make again at every replay."""

    graph: Any
    inputs: list[torch.Tensor]
    logits: torch.Tensor | None
    eager: Callable | None = None


class StepGraphs:
    """Whole decode steps of ``split`` on ``device`` for the token counts ``sizes`` and
    ``slots`` micro-batch slots (module docstring). ``host_box``: the mailbox as the host and
    the nodes see it; ``device_box``: as the graph sees it (the same memory; ``host_box``
    itself on CPU); ``flags``: :class:`CudaFlags` over ``device_box``, or :class:`HostFlags`
    with ``eager=True``."""

    def __init__(self, split: SplitModel, device: torch.device | str, sizes: Sequence[int],
                 host_box: Mailbox, device_box: Mailbox, flags, eager: bool = False) -> None:
        self.split, self.device, self.eager = split, torch.device(device), eager
        self.host_box, self.device_box, self.flags = host_box, device_box, flags
        shape = host_box.shape
        self.sizes = tuple(s for s in sorted(set(sizes)) if s <= shape.tokens)
        if not self.sizes:
            raise ValueError(f"no graph size fits the mailbox's {shape.tokens} rows")
        self.layers = len(split.specs)
        self.replays = 0
        self.steps: dict[tuple[int, int], _Step] = {}
        with torch.inference_mode():
            for slot in range(shape.slots):
                pool = None if eager else torch.cuda.graph_pool_handle()  # own buffers per slot
                for size in reversed(self.sizes):
                    self.steps[(slot, size)] = self._capture(slot, size, pool)

    # -- capture -------------------------------------------------------------------------------
    def _attend(self, slot: int) -> Callable:
        box, nodes = self.device_box, self.device_box.shape.nodes
        q_box, k_box, v_box = box.qkv(slot)
        landing = [box.landing(slot, n) for n in range(nodes)]

        def attend(k: int, q: torch.Tensor, kk: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            t = q.shape[0]
            q_box[:t].copy_(q)
            k_box[:t].copy_(kk)
            v_box[:t].copy_(v)
            self.flags.signal(slot, k + 1)
            for n in range(nodes):
                self.flags.wait(slot, n, k + 1)
            return merge([o[:t] for o, _ in landing], [lse[:t] for _, lse in landing])
        return attend

    def _capture(self, slot: int, size: int, pool) -> _Step:
        dev = self.device
        inputs = [torch.zeros(size, dtype=torch.long, device=dev),
                  torch.zeros(size, dtype=torch.long, device=dev),
                  torch.arange(size, device=dev)]
        attend = self._attend(slot)

        def step(tokens, positions, rows):
            return self.split.forward(tokens, positions, rows, attend)

        if self.eager:  # the graph's calls, made again at every replay
            return _Step(None, inputs, None, step)
        return self._capture_cuda(step, inputs, pool)

    def _capture_cuda(self, step: Callable, inputs: list[torch.Tensor], pool) -> _Step:
        """Warm up on a side stream with attention zeroed (no node sees a warm-up), then
        capture ``step`` with its sends and waits."""
        def zeros(k, q, kk, v):
            return torch.zeros_like(q)

        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                self.split.forward(*inputs, zeros)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            logits = step(*inputs)
        return _Step(graph, inputs, logits)

    # -- replay --------------------------------------------------------------------------------
    def size_for(self, tokens: int) -> int | None:
        return next((s for s in self.sizes if s >= tokens), None)

    def holds(self, plan: StepPlan, routes: list[NodeRoute]) -> bool:
        """Whether a graph runs ``plan`` (every row sampled, a captured size, known nodes)."""
        return plan.sample_rows.numel() == plan.num_tokens \
            and self.size_for(plan.num_tokens) is not None \
            and all(r.node < self.host_box.shape.nodes for r in routes)

    @torch.inference_mode()
    def run(self, slot: int, plan: StepPlan, routes: list[NodeRoute],
            serve: Callable[[], bool] | None = None) -> torch.Tensor:
        """Step ``plan`` on ``slot``'s graph (:meth:`holds` must be true; its PREPAREs are
        out): the logits of its sample rows, ``[R, V]``. ``serve``: the pollers of nodes in
        this process, run until the step is done. Raises where a node failed or a wait gave
        up (the step is void)."""
        t = plan.num_tokens
        size = self.size_for(t)
        cap = self.steps[(slot, size)]
        self.host_box.post(slot, plan.step_id, t, routes, self.layers, size)
        for static, new in zip(cap.inputs, (plan.token_ids, plan.positions, plan.sample_rows)):
            static[:t].copy_(new)
            static[t:].zero_()
        self.replays += 1
        if self.eager:
            logits = cap.eager(*cap.inputs)
        else:
            cap.graph.replay()
            done = torch.cuda.Event()
            done.record()
            while not done.query():
                if serve is None or not serve():
                    time.sleep(0)
            logits = cap.logits
        self.host_box.check(slot)
        return logits[:plan.sample_rows.numel()].to("cpu")


def mailbox_shape(split: SplitModel, nodes: int, slots: int, tokens: int, dtype: torch.dtype
                  ) -> MailboxShape:
    """The mailbox of ``split``'s whole steps: ``slots`` micro-batch slots of up to ``tokens``
    rows of q/k/v in ``dtype`` for ``nodes`` memory nodes."""
    spec = split.specs[0]
    if any((s.num_heads, s.num_kv_heads, s.head_dim) != (spec.num_heads, spec.num_kv_heads,
                                                         spec.head_dim) for s in split.specs):
        raise ValueError("whole-step graphs need every attention layer of one shape")
    return MailboxShape(slots, nodes, tokens, spec.num_heads, spec.num_kv_heads, spec.head_dim,
                        dtype)


def build_step_graphs(mode: str, split: SplitModel, devices: Sequence[torch.device],
                      host: Mailbox, serve: Callable[[], bool]
                      ) -> tuple[dict[int, StepGraphs], Callable[[], None]]:
    """Whole-step graphs for replicas on ``devices`` (replica index -> :class:`StepGraphs`)
    over the mailbox ``host`` (host memory); ``serve``: what a wait runs meanwhile (the
    pollers of nodes in this process, stand-ins for dead ones; whether it answered anything).
    ``mode``: ``cuda`` (CUDA graphs over ``host`` mapped into the GPU) or ``emulated`` (the CPU
    stand-in). Returns ``(graphs, close)``; ``close`` unmaps ``host`` from the GPU."""
    from lamina.computenode.cuda_graphs import capture_sizes

    sizes = capture_sizes(host.shape.tokens)
    if mode == "emulated":
        flags = HostFlags(host, serve)
        return ({i: StepGraphs(split, d, sizes, host, host, flags, eager=True)
                 for i, d in enumerate(devices)}, lambda: None)
    if mode != "cuda":
        raise ValueError(f"whole-step graphs need device_polling cuda or emulated; got {mode!r}")
    from lamina.computenode.device_wait import mapped_alias

    if len({torch.device(d) for d in devices}) != 1:
        raise ValueError("whole-step graphs run the replicas of one process on one GPU")
    alias, unregister = mapped_alias(host.buffer, torch.device(devices[0]).index or 0)
    try:
        box = Mailbox(host.shape, alias)
        flags = CudaFlags(box)
        graphs = {i: StepGraphs(split, d, sizes, host, box, flags) for i, d in enumerate(devices)}
    except BaseException:
        unregister()
        raise
    return graphs, unregister


def device_steps(mode: str, split: SplitModel, devices: Sequence[torch.device],
                 attends: Sequence[Callable], slots: int, tokens: int, dtype: torch.dtype
                 ) -> tuple[dict[int, StepGraphs], Callable[[], bool], Callable[[], None]]:
    """Whole-step graphs (:func:`build_step_graphs`) against the memory nodes in this process
    whose ATTEND is ``attends[n]`` (:meth:`MemoryNode.attend`), over a mailbox in this
    process's memory (:func:`mailbox_shape`). Returns ``(graphs, serve, close)``: ``serve``
    polls every node's mailbox once (whether it answered anything), ``close`` releases the
    mailbox."""
    host = Mailbox(shape := mailbox_shape(split, len(attends), slots, tokens, dtype),
                   host_buffer(shape))
    servers = [MailboxServer(host, n, a) for n, a in enumerate(attends)]

    def serve() -> bool:
        return any([s.poll() for s in servers])

    graphs, close = build_step_graphs(mode, split, devices, host, serve)
    return graphs, serve, close
