"""Render a split model's dataflow graph with its cuts as a PNG (``lamina split --draw``)."""
from __future__ import annotations

from pathlib import Path

import networkx as nx

from lamina.splitter.graph import to_digraph


def draw_split(sm, path: str | Path, max_slices: int = 8) -> Path:
    """Draw the token nodes of the first ``max_slices`` slices, one column per slice; attention
    nodes are red diamonds and context values crossing a cut are red edges labelled with bytes
    per token. Replicated nodes (position tables, shape arithmetic) are left out."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    part = sm.partition
    if sm.graph is None:
        raise ValueError("drawing needs the split's graph, which a split read back from a "
                         "folder does not keep: draw a fresh split (lamina split MODEL --draw)")
    g = to_digraph(sm.graph, part.bytes_per_token)
    keep = [n for n, k in part.slice_of.items() if k < max_slices]
    sub = g.subgraph(keep).copy()
    order = {n: i for i, n in enumerate(nx.topological_sort(sub))}
    rows: dict[int, int] = {}
    pos = {}
    for n in sorted(sub.nodes, key=order.__getitem__):
        k = part.slice_of[n]
        if n in part.attentions:
            pos[n] = (k + 0.5, -rows.get(k, 0) / 2)
            continue
        rows[k] = rows.get(k, 0) + 1
        pos[n] = (k, -rows[k])
    attn = [n for n in sub.nodes if n in part.attentions]
    normal = [n for n in sub.nodes if n not in part.attentions]
    cut = [(u, v) for u, v in sub.edges
           if u not in part.attentions and part.slice_of[u] < part.slice_of[v]]
    rest = [e for e in sub.edges if e not in set(cut)]
    height = max(rows.values(), default=1)
    fig, ax = plt.subplots(figsize=(2.2 * min(max_slices, len(rows)) + 2, max(6, height * 0.12)))
    nx.draw_networkx_edges(sub, pos, edgelist=rest, ax=ax, width=0.3, alpha=0.4, arrows=False)
    nx.draw_networkx_edges(sub, pos, edgelist=cut, ax=ax, width=1.5, edge_color="red", arrows=True)
    nx.draw_networkx_nodes(sub, pos, nodelist=normal, node_size=8, ax=ax,
                           node_color=[part.slice_of[n] for n in normal], cmap="tab10")
    nx.draw_networkx_nodes(sub, pos, nodelist=attn, node_size=60, node_shape="D",
                           node_color="red", ax=ax)
    labels = {e: f"{part.bytes_per_token.get(e[0], 0):.0f} B/tok" for e in cut
              if part.slice_of[e[1]] == part.slice_of[e[0]] + 1}
    nx.draw_networkx_edge_labels(sub, pos, edge_labels=labels, font_size=6, ax=ax)
    ax.set_title(f"{len(sm.slices)} slices (first {min(max_slices, len(sm.slices))} shown); "
                 "red diamonds: attention; red edges: context across a cut")
    ax.axis("off")
    path = Path(path)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path
