"""Whole-step graphs in a replica process whose memory nodes are processes of their own
(issue 41, item 3; :mod:`lamina.computenode.step_graphs`).

The replica's process owns the step mailbox: a memory file (:class:`SharedMailbox`) that the
graphs reach mapped into the GPU (or, emulated, as it is) and that each node maps on a MAILBOX
message on its peer link (:meth:`RemoteSteps.attach`), then serves from a thread of its own
(:mod:`lamina.memnode.mailbox_loop`). Node ``k`` of the mailbox is the replica's link ``k``
(the engine's node order); a node attached later (borrowed) is not in it, and steps routed
there run slice by slice.

While a graph runs, the replica's thread watches the nodes' liveness (:meth:`RemoteSteps.serve`,
at most every ``CHECK_S``): for a node found dead a stand-in answers every SEND GONE, so the
step ends at once with the node named instead of at the device wait's timeout; the engine's
recovery then starts a node in its place, which :meth:`RemoteSteps.attach` joins to the
mailbox from the SENDs answered so far.
"""
from __future__ import annotations

import time
from typing import Any, Callable, Sequence

import torch

from lamina.computenode.step_graphs import StepGraphs, build_step_graphs, mailbox_shape
from lamina.errors import NodeFailure
from lamina.splitter import SplitModel
from lamina.transport.mailbox import Mailbox, MailboxServer, SharedMailbox
from lamina.transport.wire import Message, MsgKind
from lamina.types import AttendMsg, AttendResult

CHECK_S = 0.01  # how often a running step checks that its nodes are alive
MAILBOX_STEP = -2  # the step id of a MAILBOX (the node's ERROR for it fails every step)


class RemoteSteps:
    """Whole-step graphs of replica ``index`` on ``device`` (``mode``: ``cuda`` or
    ``emulated``) for ``slots`` micro-batch slots of up to ``tokens`` rows in ``dtype``,
    against the memory nodes behind ``links`` (the replica's channels to them, in the
    engine's node order; ``link.peer_alive()`` says whether a node is up). :attr:`graphs` is
    the runner's ``step_graphs``, :meth:`serve` its ``serve``."""

    def __init__(self, mode: str, split: SplitModel, index: int, device: torch.device | str,
                 slots: int, tokens: int, dtype: torch.dtype, links: Sequence[Any]) -> None:
        shape = mailbox_shape(split, len(links), slots, tokens, dtype)
        self.shared = SharedMailbox(shape)
        self.box = Mailbox(shape, self.shared.buffer)
        self.links = list(links)
        self.stand_ins: dict[int, MailboxServer] = {}
        self._checked = 0.0
        try:
            graphs, self._unmap = build_step_graphs(mode, split, [torch.device(device)],
                                                    self.box, self.serve)
        except BaseException:
            self.shared.close()
            raise
        self.graphs: dict[int, StepGraphs] = {index: graphs[0]}

    def attach(self, k: int, link: Any) -> Message | None:
        """The MAILBOX message that joins node ``k``, now behind ``link``, to the mailbox
        (None: ``k`` is not in it); a stand-in for ``k`` ends."""
        if not 0 <= k < self.box.shape.nodes:
            return None
        self.links[k] = link
        self.stand_ins.pop(k, None)
        return Message(MsgKind.MAILBOX, MAILBOX_STEP, meta={**self.shared.handle, "node": k})

    def serve(self) -> bool:
        """What a running step does meanwhile: stand in for the nodes found dead (whether it
        answered anything)."""
        now = time.monotonic()
        if now - self._checked >= CHECK_S:
            self._checked = now
            for k, link in enumerate(self.links):
                if k not in self.stand_ins and not _alive(link):
                    self.stand_ins[k] = MailboxServer(self.box, k, _gone(k))
        return any([s.poll() for s in self.stand_ins.values()])

    def close(self) -> None:
        self._unmap()
        self.shared.close()


def _alive(link: Any) -> bool:
    alive: Callable[[], bool] | None = getattr(link, "peer_alive", None)
    return not getattr(link, "closed", False) and (alive is None or alive())


def _gone(k: int) -> Callable[[AttendMsg], AttendResult]:
    def attend(msg: AttendMsg) -> AttendResult:
        raise NodeFailure(f"memory node {k} is gone (step {msg.step_id}, layer {msg.layer})")
    return attend
