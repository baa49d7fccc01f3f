"""Engine <-> compute replica messages: STEP (a StepPlan, its per-node routes, and what to
sample) and TOKENS (the sampled ids), on the same wire protocol as the memory nodes.

STEP tensors: ``token_ids``, ``positions``, ``sample_rows``, then per route ``q_rows`` and
``kv_rows`` (all int64), then optionally the sampling ``uniforms`` (float32). Meta: step id,
micro-batch, whether it is alone, segments, routes (node, works), request ids and their
SamplingParams as plain JSON.
"""
from __future__ import annotations

from dataclasses import asdict

import torch

from lamina.types import NodeRoute
from lamina.transport.wire import Message, MsgKind, WireError
from lamina.types import SamplingParams, Segment, ShardWork, StepPlan


def step_message(plan: StepPlan, routes: list[NodeRoute], req_ids: list[int],
                 params: list[SamplingParams], uniforms: torch.Tensor | None = None) -> Message:
    """``uniforms[R]`` (float32, :meth:`Sampler.draw`), when given, travels as a last tensor:
    the replica that samples then uses them instead of its own generators."""
    meta = {"micro_batch": plan.micro_batch, "alone": plan.alone, "uniforms": uniforms is not None,
            "segments": [[s.req_id, s.start_pos, s.num_tokens] for s in plan.segments],
            "routes": [{"node": r.node,
                        "works": [[w.req_id, w.q_start, w.num_q, w.append_start, w.num_append]
                                  for w in r.works]} for r in routes],
            "req_ids": list(req_ids), "params": [asdict(p) for p in params]}
    tensors = [plan.token_ids, plan.positions, plan.sample_rows]
    for r in routes:
        tensors += [r.q_rows, r.kv_rows]
    if uniforms is not None:
        tensors.append(uniforms.to(torch.float32))
    return Message(MsgKind.STEP, step_id=plan.step_id, meta=meta, tensors=tensors)


def parse_step(msg: Message) -> tuple[StepPlan, list[NodeRoute], list[int], list[SamplingParams]]:
    m, t = msg.meta, msg.tensors
    try:
        routes_meta = m["routes"]
        if len(t) != 3 + 2 * len(routes_meta) + bool(m.get("uniforms")):
            raise WireError(f"STEP has {len(t)} tensors for {len(routes_meta)} routes")
        plan = StepPlan(msg.step_id, int(m["micro_batch"]),
                        [Segment(*map(int, s)) for s in m["segments"]], t[0], t[1], t[2],
                        bool(m["alone"]))
        routes = [NodeRoute(int(r["node"]), [ShardWork(*map(int, w)) for w in r["works"]],
                            t[3 + 2 * i], t[4 + 2 * i])
                  for i, r in enumerate(routes_meta)]
        params = [SamplingParams(**p) for p in m["params"]]  # validates every field
        req_ids = [int(r) for r in m["req_ids"]]
    except (KeyError, TypeError, ValueError) as e:
        raise WireError(f"malformed STEP message: {e}") from e
    if len(params) != len(req_ids) or len(req_ids) != plan.sample_rows.numel():
        raise WireError("STEP: sample rows, request ids and params disagree")
    return plan, routes, req_ids, params


def step_uniforms(msg: Message) -> torch.Tensor | None:
    """The STEP's sampling uniforms ``float32[R]``, or None when the replica draws its own."""
    if not msg.meta.get("uniforms"):
        return None
    u = msg.tensors[-1]
    if u.dtype != torch.float32 or u.shape != msg.tensors[2].shape:
        raise WireError("STEP: uniforms must be float32 with one value per sample row")
    return u


def tokens_message(step_id: int, tokens: list[int]) -> Message:
    return Message(MsgKind.TOKENS, step_id=step_id,
                   tensors=[torch.tensor(tokens, dtype=torch.long)])


def parse_tokens(msg: Message) -> list[int]:
    if msg.kind != MsgKind.TOKENS or len(msg.tensors) != 1:
        raise WireError(f"expected a TOKENS message, got {msg.kind!r}")
    return msg.tensors[0].tolist()
