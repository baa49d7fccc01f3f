"""Prefix caching: a radix tree over token ids, knowing which memory node holds each cached
prefix's KV (pure Python, no torch; the engine turns its ops into node calls).

A tree node is an edge of tokens, positions ``[start, end)`` of every sequence through it, whose
KV lives on memory node ``node`` in the node-side *entry* ``entry`` (a shard with an id of its
own, negative so it never meets a request id, covering at least ``[start, end)``). Every path
from the root lies on one memory node. The tree owns the slots of its edges: the scheduler
counts them as used (:attr:`PrefixCache.held`) until evicted.

* **match** (:meth:`PrefixCache.attach`): a request takes the longest cached prefix of its
  tokens (at most all but its last token: one must be computed for logits); the request's
  shard on that node starts as the shared slots (a :class:`Share` op, node-side reference
  counts), and the path is locked while the request holds it (:meth:`PrefixCache.release`).
* **insert** (:meth:`PrefixCache.insert`, when a request finishes, and
  :meth:`PrefixCache.extend`, after each prefill chunk): its KV on its first node beyond what
  the tree holds becomes a new edge (a new entry sharing the request's slots); a running
  request then holds that edge as part of its cached prefix.
* **evict** (:meth:`PrefixCache.evict`): unlocked leaves, least recently used first, when a
  pool runs short (before any preemption); an evicted edge is always the back of its entry,
  so the node frees a suffix range or the whole entry (:class:`Drop` ops).

The engine applies :meth:`PrefixCache.take_ops` on the nodes, in order, before the step they
were made for is submitted.
"""
from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field

__all__ = ["CacheNode", "Drop", "Hit", "PrefixCache", "Share"]


@dataclass
class Share:
    """On memory node ``node``, make shard ``dst`` from the slots of ``parts = [(src, start,
    end)]`` (consecutive position ranges of other shards; :meth:`MemoryNode.share`)."""

    node: int
    dst: int
    parts: list[tuple[int, int, int]]


@dataclass
class Drop:
    """On memory node ``node``, free positions ``[start, end)`` of entry ``entry`` (its back or
    all of it)."""

    node: int
    entry: int
    start: int
    end: int


@dataclass(eq=False)
class Hit:
    """A request's cached prefix: ``length`` positions on memory node ``share.node``, the path
    ending at ``last`` (locked), and the Share that gives the request's shard those slots."""

    last: "CacheNode"
    length: int
    share: Share

    @property
    def node(self) -> int:
        return self.share.node


@dataclass(eq=False)
class CacheNode:
    """An edge: ``tokens`` at positions ``[start, start + len(tokens))`` (see module docstring).
    ``locks``: requests holding a path through it; ``last_used``: a logical clock."""

    tokens: list[int]
    start: int
    node: int
    entry: int
    parent: "CacheNode | None"
    children: dict[int, "CacheNode"] = field(default_factory=dict)
    locks: int = 0
    last_used: int = 0

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)


class PrefixCache:
    """The radix tree of one engine (see module docstring). ``num_nodes``: its own memory nodes
    (borrowed nodes, at higher indices, never hold cached prefixes)."""

    def __init__(self, num_nodes: int):
        self.root = CacheNode([], 0, -1, 0, None)
        self.held = [0] * num_nodes  # slots the tree owns, per memory node
        self._extent: dict[int, list[int]] = {}  # entry -> [start, end, memory node] still held
        self._entries = itertools.count(1)
        self._clock = itertools.count(1)
        self._ops: list[Share | Drop] = []
        self.queries = 0  # tokens looked up (prompt tokens of admitted requests)
        self.hits = 0  # of which found cached

    # -- node ops ---------------------------------------------------------------------------------
    def take_ops(self) -> list[Share | Drop]:
        """The node calls made since the last take, in order (the caller applies them all)."""
        ops, self._ops = self._ops, []
        return ops

    def stats(self) -> tuple[int, int, int]:
        """(prompt tokens looked up, of which found cached, slots the tree holds)."""
        return self.queries, self.hits, sum(self.held)

    def is_entry(self, shard_id: int) -> bool:
        return shard_id < 0 and -shard_id in self._extent

    # -- lookup -----------------------------------------------------------------------------------
    def _walk(self, tokens: list[int]) -> tuple[CacheNode, int]:
        """The deepest node whose edge shares tokens with ``tokens``, and the matched length."""
        cur, n = self.root, 0
        while n < len(tokens):
            child = cur.children.get(tokens[n])
            if child is None:
                break
            k = min(len(child.tokens), len(tokens) - n)
            if child.tokens[:k] != tokens[n:n + k]:  # compared in C first; then find where
                k = next(i for i in range(k) if child.tokens[i] != tokens[n + i])
            cur, n = child, n + k
            if k < len(child.tokens):
                break
        return cur, n

    def attach(self, req_id: int, tokens: list[int]) -> Hit | None:
        """Lock the longest cached prefix of ``tokens[:-1]`` for request ``req_id``; None on a
        miss. The hit's Share is queued by :meth:`commit` once the request is placed, or the
        lock dropped by :meth:`release` if it is not."""
        last, n = self._walk(tokens[:-1])
        if n == 0:
            return None
        tick = next(self._clock)
        parts: list[tuple[int, int, int]] = []
        for cur in self._path(last):
            cur.locks += 1
            cur.last_used = tick
            end = min(cur.end, n)
            if parts and parts[0][0] == -cur.entry and parts[0][1] == end:
                parts[0] = (-cur.entry, cur.start, parts[0][2])
            else:
                parts.insert(0, (-cur.entry, cur.start, end))
        return Hit(last, n, Share(last.node, req_id, parts))

    def commit(self, hit: Hit, prompt_tokens: int) -> None:
        """The request of ``hit`` was placed: queue its Share; ``prompt_tokens`` it looked up."""
        self._ops.append(hit.share)
        self.queries += prompt_tokens
        self.hits += hit.length

    def miss(self, prompt_tokens: int) -> None:
        """A request was admitted without a hit."""
        self.queries += prompt_tokens

    def release(self, last: CacheNode) -> None:
        """A request no longer holds the path ending at ``last`` (see :meth:`attach`)."""
        cur = last
        while cur is not None and cur is not self.root:
            cur.locks -= 1
            cur = cur.parent

    # -- insert -----------------------------------------------------------------------------------
    def insert(self, req_id: int, tokens: list[int], node: int) -> int:
        """Cache ``tokens`` (a finished request's positions ``0 .. len-1``, whose KV is on memory
        node ``node`` in shard ``req_id``): the part beyond what the tree holds becomes a new
        edge sharing the request's slots. Returns the positions the tree took over (the
        request must not free them from the scheduler's count); 0 where the known part lies
        on another node or ``node`` is borrowed."""
        child = self._add(req_id, tokens, node, None)
        return 0 if child is None else len(child.tokens)

    def extend(self, req_id: int, tokens: list[int], node: int, cached: int,
               last: CacheNode | None) -> CacheNode | None:
        """A running request's computed positions ``0 .. len(tokens)-1`` on ``node``, of which
        the first ``cached`` are the tree's already (its path ending at ``last``, or none):
        the tree takes the rest over when what it holds of ``tokens`` ends exactly at
        ``cached``. Returns the request's new last node (locked for it; ``last`` released),
        or None (nothing changed): a prefill chunk's KV serves requests admitted meanwhile."""
        child = self._add(req_id, tokens, node, cached)
        if child is None:
            return None
        for p in self._path(child):
            p.locks += 1
        if last is not None:
            self.release(last)
        return child

    def _add(self, req_id: int, tokens: list[int], node: int, at: int | None) -> CacheNode | None:
        """The new edge of :meth:`insert` / :meth:`extend` (``at``: where the tree's part of
        ``tokens`` must end), with its Share queued; None if there is nothing to add."""
        if len(tokens) == 0 or node >= len(self.held):
            return None
        cur, n = self._walk(tokens)
        if (n and cur.node != node) or n == len(tokens) or (at is not None and n != at):
            return None
        if n < cur.end:  # the match ends inside cur's edge: split it there
            cur = self._split(cur, n)
        tick = next(self._clock)
        for p in self._path(cur):
            p.last_used = tick
        entry = next(self._entries)
        child = CacheNode(list(tokens[n:]), n, node, entry, cur, last_used=tick)
        cur.children[tokens[n]] = child
        self._extent[entry] = [n, len(tokens), node]
        self.held[node] += len(tokens) - n
        self._ops.append(Share(node, -entry, [(req_id, n, len(tokens))]))
        return child

    def _split(self, node: CacheNode, at: int) -> CacheNode:
        """Split ``node``'s edge at position ``at``: a new parent takes ``[start, at)`` (same
        entry, same locks) and ``node`` keeps ``[at, end)`` (so a request's ``last`` stays
        valid). Returns the new parent."""
        k = at - node.start
        top = CacheNode(node.tokens[:k], node.start, node.node, node.entry, node.parent,
                        locks=node.locks, last_used=node.last_used)
        node.parent.children[node.tokens[0]] = top
        node.tokens, node.start, node.parent = node.tokens[k:], at, top
        top.children[node.tokens[0]] = node
        return top

    def _path(self, node: CacheNode):
        while node is not None and node is not self.root:
            yield node
            node = node.parent

    # -- eviction ---------------------------------------------------------------------------------
    def evictable(self, node: int) -> int:
        """Slots on memory node ``node`` that evictions could free (no request holds them)."""
        return sum(len(n.tokens) for n in self._nodes() if n.node == node and not n.locks)

    def evict(self, slots: int, node: int | None = None) -> list[tuple[int, int]]:
        """Evict unlocked leaves (on memory node ``node`` only, if given), least recently used
        first, until at least ``slots`` slots are freed or none is left; returns ``[(memory
        node, slots freed)]`` and queues the Drops."""
        heap = [(n.last_used, id(n), n) for n in self._nodes()
                if not n.children and not n.locks and node in (None, n.node)]
        heapq.heapify(heap)
        freed: list[tuple[int, int]] = []
        total = 0
        while heap and total < slots:
            _, _, leaf = heapq.heappop(heap)
            freed.append((leaf.node, self._remove(leaf)))
            total += freed[-1][1]
            parent = leaf.parent
            if (parent is not self.root and not parent.children and not parent.locks
                    and node in (None, parent.node)):
                heapq.heappush(heap, (parent.last_used, id(parent), parent))
        return freed

    def _remove(self, leaf: CacheNode) -> int:
        del leaf.parent.children[leaf.tokens[0]]
        ext = self._extent[leaf.entry]
        if ext[1] != leaf.end:
            raise RuntimeError(f"prefix cache: edge [{leaf.start}, {leaf.end}) is not the back of "
                               f"entry {leaf.entry} [{ext[0]}, {ext[1]})")
        self._ops.append(Drop(leaf.node, -leaf.entry, leaf.start, leaf.end))
        ext[1] = leaf.start
        if ext[0] == ext[1]:
            del self._extent[leaf.entry]
        self.held[leaf.node] -= len(leaf.tokens)
        return len(leaf.tokens)

    def drop_node(self, node: int) -> int:
        """Forget every cached prefix on memory node ``node`` (it died; its KV is gone): no node
        op. Returns the slots the tree held there."""
        held, self.held[node] = self.held[node], 0
        for child in [c for c in self.root.children.values() if c.node == node]:
            del self.root.children[child.tokens[0]]
            child.parent = None
        for entry in [e for e, ext in self._extent.items() if ext[2] == node]:
            del self._extent[entry]
        return held

    def _nodes(self):
        stack = list(self.root.children.values())
        while stack:
            n = stack.pop()
            yield n
            stack.extend(n.children.values())
