"""A compute replica in another process (a Ray actor): its serve loop and the engine's client.

Requests, one reply each, in order: STEP -> TOKENS, FREE -> OK, STATS -> OK with every memory
node's stats, PING -> OK, SHUTDOWN -> OK then the loop ends. A failing request gets an ERROR
reply; a memory node failure (NodeFailure) is reported the same way and re-raised on the
engine side as NodeFailure.
"""
from __future__ import annotations

from dataclasses import asdict

from lamina.pool import NodeFailure
from lamina.remote import serve_loop
from lamina.step_codec import parse_step, parse_tokens, step_message, tokens_message
from lamina.transport import codec
from lamina.transport.base import ChannelClosed, PeerDied
from lamina.transport.wire import Message, MsgKind
from lamina.types import NodeStats
from lamina.worker import ReplicaWorker, WorkerClient

codec.register_error(NodeFailure)
REPLY_TIMEOUT_S = 600.0


def handle_worker(worker: ReplicaWorker, msg: Message) -> Message:
    try:
        if msg.kind == MsgKind.STEP:
            return tokens_message(msg.step_id, worker.execute(*parse_step(msg)))
        if msg.kind == MsgKind.FREE:
            worker.free([int(r) for r in msg.meta["req_ids"]],
                        [int(r) for r in msg.meta.get("release", [])])
            return codec.ok()
        if msg.kind == MsgKind.STATS:
            return codec.ok({"nodes": [asdict(s) for s in worker.stats()]})
        if msg.kind in (MsgKind.PING, MsgKind.SHUTDOWN):
            return codec.ok()
        raise ValueError(f"compute replica cannot handle a {msg.kind.name} message")
    except Exception as e:
        return codec.to_message(e)


def serve_worker(worker: ReplicaWorker, ch) -> None:
    """Answer the engine on ``ch`` until SHUTDOWN or until the engine is gone; then close the
    replica's memory-node connections."""

    def close_nodes() -> None:
        for node in worker.nodes:
            node.close()

    serve_loop(ch, lambda msg: handle_worker(worker, msg), on_exit=close_nodes)


class RemoteWorker(WorkerClient):
    """Engine-side client of a compute replica reached over a channel."""

    def __init__(self, channel, name: str = "compute replica 0"):
        self.ch = channel
        self.name = name

    def _call(self, msg: Message, timeout: float = REPLY_TIMEOUT_S) -> Message:
        try:
            self.ch.send(msg)
            return codec.raise_if_error(self.ch.recv(timeout))
        except (PeerDied, ChannelClosed, TimeoutError) as e:
            raise NodeFailure(f"{self.name} is unreachable: {e}") from e

    def execute(self, plan, routes, req_ids, params) -> list[int]:
        return parse_tokens(self._call(step_message(plan, routes, req_ids, params)))

    def submit(self, slot, plan, routes, req_ids, params) -> None:
        """Send the STEP and return at once (the replica runs it while this process does other
        work, e.g. other instances' steps); ``wait`` receives its TOKENS."""
        if slot != 0 or getattr(self, "_pending", None) is not None:
            raise ValueError(f"this worker runs one micro-batch at a time (slot {slot})")
        try:
            self.ch.send(step_message(plan, routes, req_ids, params))
        except (PeerDied, ChannelClosed, TimeoutError) as e:
            raise NodeFailure(f"{self.name} is unreachable: {e}") from e
        self._pending = plan.step_id

    def wait(self) -> list[tuple[int, list[int]]]:
        if getattr(self, "_pending", None) is None:
            return []
        self._pending = None
        try:
            return [(0, parse_tokens(codec.raise_if_error(self.ch.recv(REPLY_TIMEOUT_S))))]
        except (PeerDied, ChannelClosed, TimeoutError) as e:
            raise NodeFailure(f"{self.name} is unreachable: {e}") from e

    def free(self, req_ids: list[int], release: list[int]) -> None:
        self._call(Message(MsgKind.FREE, meta={"req_ids": list(req_ids),
                                               "release": list(release)}))

    def stats(self) -> list[NodeStats]:
        nodes = self._call(Message(MsgKind.STATS)).meta["nodes"]
        return [NodeStats(**{**n, "shards": {int(k): tuple(v) for k, v in n["shards"].items()}})
                for n in nodes]

    def close(self) -> None:
        if not self.ch.closed:
            try:
                self.ch.send(Message(MsgKind.SHUTDOWN))
                self.ch.recv(5.0)
            except Exception:
                pass
            self.ch.close()
