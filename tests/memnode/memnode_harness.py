"""A small test engine driving MemoryNodes, and an independent plain-torch attention oracle.

``Cluster`` plays the engine's part for the memory nodes: it turns segments into per-node
PREPARE messages (appends go to the node that the test's placement names for each position;
queries go to every node holding part of the request), sends one ATTEND per node and layer (or
``parts`` mini-batches of its works) with random q/k/v, merges shards with ``lamina.kernels.merge_states`` and checks every query row
against :func:`oracle`, computed in float64 from the full K/V history kept here (never read
back from a node).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from lamina.kernels import merge_states
from lamina.memnode import MemoryNode
from lamina.types import AttendMsg, AttentionSpec, PrepareMsg, ShardWork


def oracle(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
           spec: AttentionSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``q[t,H,D]`` over the full history ``k/v[P,Hkv,D]`` (positions 0..P-1)."""
    H = q.shape[1]
    kv_head = torch.arange(H) // (H // k.shape[1])
    kh, vh = k.double()[:, kv_head], v.double()[:, kv_head]  # [P,H,D]
    s = torch.einsum("thd,phd->htp", q.double(), kh) * spec.scale
    if spec.softcap is not None:
        s = spec.softcap * torch.tanh(s / spec.softcap)
    pos = torch.arange(k.shape[0])
    visible = pos[None, :] <= q_pos[:, None]
    if spec.window is not None:
        visible &= q_pos[:, None] - pos[None, :] < spec.window
    s = s.masked_fill(~visible[None], float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    o = torch.einsum("htp,phd->thd", torch.softmax(s, dim=-1), vh)
    return o, lse.T


@dataclass
class _Pending:
    step_id: int
    segments: list[tuple[int, int, int]]
    q: list[list[torch.Tensor]]  # [layer][segment] -> [n,H,D]
    k: list[list[torch.Tensor]]  # [layer][segment] -> [n,Hkv,D]
    v: list[list[torch.Tensor]]
    plan: dict[str, list[tuple[int, ShardWork]]] = field(default_factory=dict)


class Cluster:
    """Memory nodes by name plus the test's own record of every request's K/V history."""

    def __init__(self, specs: list[AttentionSpec], nodes: dict[str, MemoryNode], seed: int = 0,
                 atol: float = 2e-5, parts: int = 1) -> None:
        self.specs, self.nodes, self.atol, self.parts = specs, nodes, atol, parts
        self.gen = torch.Generator().manual_seed(seed)
        self.hist_k: dict[int, list[torch.Tensor]] = {}
        self.hist_v: dict[int, list[torch.Tensor]] = {}
        self.place: dict[int, list[tuple[int, str]]] = {}  # req -> [(from_pos, node)] sorted
        self.holders: dict[int, set[str]] = {}  # nodes holding part of each request
        self.step_ids = itertools.count(1)
        self.checked_rows = 0

    def length(self, req: int) -> int:
        return self.hist_k[req][0].shape[0] if req in self.hist_k else 0

    def node_of(self, req: int, pos: int) -> str:
        return [name for start, name in self.place[req] if start <= pos][-1]

    def _rand(self, *shape: int, scale: float = 1.0) -> torch.Tensor:
        return torch.randn(*shape, generator=self.gen) * scale

    def prepare(self, segments: list[tuple[int, int, int]]) -> _Pending:
        """Send PREPARE for one micro-batch of ``(req, start_pos, num_tokens)`` segments."""
        H, Hkv, D = self.specs[0].num_heads, self.specs[0].num_kv_heads, self.specs[0].head_dim
        L = len(self.specs)
        p = _Pending(next(self.step_ids), list(segments),
                     q=[[self._rand(n, H, D, scale=2.0) for _, _, n in segments] for _ in range(L)],
                     k=[[self._rand(n, Hkv, D) for _, _, n in segments] for _ in range(L)],
                     v=[[self._rand(n, Hkv, D) for _, _, n in segments] for _ in range(L)])
        for i, (r, s, n) in enumerate(segments):
            assert self.length(r) == s, "segments must continue the request's history"
            appends: dict[str, list[int]] = {}
            for pos in range(s, s + n):
                appends.setdefault(self.node_of(r, pos), []).append(pos)
            targets = self.holders.get(r, set()) | set(appends)
            for name in sorted(targets):
                a = appends.get(name, [0])
                w = ShardWork(r, q_start=s, num_q=n, append_start=a[0],
                              num_append=len(appends.get(name, [])))
                p.plan.setdefault(name, []).append((i, w))
        for name, items in p.plan.items():  # may raise (e.g. OutOfSlots): then nothing recorded
            self.nodes[name].prepare(PrepareMsg(p.step_id, [w for _, w in items]))
        for i, (r, s, n) in enumerate(segments):
            self.holders.setdefault(r, set()).update(
                name for name, items in p.plan.items() for j, w in items if j == i and w.num_append)
            ks, vs = self.hist_k.setdefault(r, []), self.hist_v.setdefault(r, [])
            for layer in range(L):
                if len(ks) <= layer:
                    ks.append(torch.zeros(0, Hkv, D))
                    vs.append(torch.zeros(0, Hkv, D))
                ks[layer] = torch.cat([ks[layer], p.k[layer][i]])
                vs[layer] = torch.cat([vs[layer], p.v[layer][i]])
        return p

    def attend(self, p: _Pending, layer_idx: int) -> None:
        """ATTEND one layer of a prepared micro-batch on every node; check against the oracle."""
        spec = self.specs[layer_idx]
        parts: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        for name, items in p.plan.items():
            n = -(-len(items) // self.parts)  # works per mini-batch
            runs = [(a, min(a + n, len(items))) for a in range(0, len(items), n)]
            results = []
            for a, b in runs:
                sub = items[a:b]
                q = torch.cat([p.q[layer_idx][i] for i, _ in sub])
                k = torch.cat([p.k[layer_idx][i][w.append_start - w.q_start:][:w.num_append]
                               for i, w in sub])
                v = torch.cat([p.v[layer_idx][i][w.append_start - w.q_start:][:w.num_append]
                               for i, w in sub])
                works = (a, b) if len(runs) > 1 else None
                res = self.nodes[name].attend(AttendMsg(p.step_id, spec.layer, q, k, v,
                                                        works=works))
                assert res.o.dtype == q.dtype and res.lse.dtype == torch.float32
                assert res.o.shape[0] == q.shape[0]
                results.append(res)
            # nodes may live on a GPU
            res.o = torch.cat([r.o.cpu() for r in results])
            res.lse = torch.cat([r.lse.cpu() for r in results])
            row = 0
            for i, w in items:
                parts.setdefault(i, []).append((res.o[row: row + w.num_q],
                                                res.lse[row: row + w.num_q]))
                row += w.num_q
            assert row == res.o.shape[0]
        for i, (r, s, n) in enumerate(p.segments):
            os_, lses = zip(*parts[i])
            o, lse = merge_states(list(os_), list(lses)) if len(os_) > 1 else (os_[0], lses[0])
            want_o, want_lse = oracle(p.q[layer_idx][i], self.hist_k[r][layer_idx],
                                      self.hist_v[r][layer_idx], torch.arange(s, s + n), spec)
            torch.testing.assert_close(o.double(), want_o, atol=self.atol, rtol=1e-4)
            torch.testing.assert_close(lse.double(), want_lse, atol=self.atol, rtol=1e-5)
            self.checked_rows += n

    def run(self, *microbatches: list[tuple[int, int, int]]) -> None:
        """Prepare every micro-batch, then attend layer by layer, interleaving micro-batches."""
        pending = [self.prepare(mb) for mb in microbatches]
        for layer_idx in range(len(self.specs)):
            for p in pending:
                self.attend(p, layer_idx)
        for name, node in self.nodes.items():
            assert not node.in_flight, f"node {name} kept a finished step"

    def move(self, req: int, src: str, dst: str, start: int, end: int) -> None:
        """Move positions ``[start, end)`` of ``req`` (a prefix or suffix of src's shard)."""
        chunk = self.nodes[src].export(req, start, end)
        self.nodes[dst].import_kv(chunk)
        self.nodes[src].free_range(req, start, end)
        self.holders[req].add(dst)
        if self.nodes[src].shard(req) is None:
            self.holders[req].discard(src)

    def decode(self, reqs: list[int]) -> list[tuple[int, int, int]]:
        """One decode segment per request."""
        return [(r, self.length(r), 1) for r in reqs]
