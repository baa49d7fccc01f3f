"""Lamina's published numbers, recomputed from the paper's own inputs (Tables 1, 3; Figs. 1, 13).

test_costmodel_claims.py checks the qualitative claims with the builtin catalog (H100, default
MFU). This file uses the paper's inputs and compares numbers. Inputs the paper does not
publish are stated where they are used:

* MFU curve (Table 3, Figs. 1, 13). The paper uses measured A100 MFU(B) (Fig. 3, not given as
  numbers). We state ``MFU(B) = 0.52 * B^2 / (B^2 + 134^2) * 0.8^log2(tp)``: a saturating curve
  whose two parameters were fitted to the LLaMA-13B @A100 row of Table 3 at B = 128 and 1024,
  and a tensor-parallel penalty of 20 % per doubling (one parameter). The 33B @2xA100 and
  65B @4xA100 rows are then predictions, not fits.
* Fig. 13: compute devices are A100-40G (312 TFLOP/s, 1555 GB/s, 40 GB, priced at Table 1's
  A100 $17,500); memory devices are the same A100-40G hardware priced at the RTX 3090's cost
  efficiency (Lamina §6: "we take the cost efficiency of RTX 3090 GPUs for memory devices"):
  40 GB x $1600/24 GB = $2,667. Contexts 512-16384 (the figure's axis values are not given).
"""
from __future__ import annotations

import math

import pytest

from lamina.costmodel.hardware import Device, load_catalog
from lamina.costmodel.model import (PRESETS, Assumptions, homogeneous, min_interconnect_bandwidth,
                                    paper_min_bandwidth)
from lamina.costmodel.planner import best_homogeneous, best_per_dollar

CAT = load_catalog(use_env=False)
A100 = CAT["A100-80G"]


def paper_mfu(tp: int = 1):
    """The stated A100 MFU curve (module docstring), for a tensor-parallel group of ``tp``."""
    return lambda b: 0.52 * b * b / (b * b + 134.0 ** 2) * 0.8 ** math.log2(tp)


# Table 1: price $, capacity GB, bandwidth GB/s -> $/GB, $/(GB/s) as printed
TABLE1 = {"A100-80G": (219, 9.04), "H100": (456, 10.90), "RTX-3090": (67, 1.71),
          "RX-7900-XTX": (42, 1.04), "Arc-A770": (22, 0.63)}


def test_table1_cost_efficiency_columns():
    for name, (per_gb, per_gbps) in TABLE1.items():
        d = CAT[name]
        assert round(d.price_usd / d.memory_gb) == per_gb
        assert d.price_usd / d.mem_bw_gbps == pytest.approx(per_gbps, abs=0.0051)  # 0.625 -> 0.63


def test_table1_alpha_range_3_27_to_17_3():
    """alpha: how much more memory capacity *and* bandwidth per dollar (the lesser of the two
    ratios) a consumer card buys than an A100/H100. Lamina §4.1: 3.27x-17.3x, from the
    rounded Table 1 columns."""
    ratios = [min(TABLE1[hi][0] / TABLE1[lo][0], TABLE1[hi][1] / TABLE1[lo][1]) for hi in ("A100-80G", "H100")
              for lo in ("RTX-3090", "RX-7900-XTX", "Arc-A770")]
    assert min(ratios) == pytest.approx(3.27, abs=0.005)  # A100 vs RTX 3090, $/GB
    assert max(ratios) == pytest.approx(17.3, abs=0.01)  # H100 vs Arc A770, $/(GB/s)
    exact = [CAT[hi].price_usd / CAT[hi].memory_gb / (CAT[lo].price_usd / CAT[lo].memory_gb)
             for hi in ("A100-80G",) for lo in ("RTX-3090",)]
    assert exact[0] == pytest.approx(3.27, rel=0.01)  # unrounded: 3.28


TABLE3 = {  # model, A100s (tensor parallel), GB/s at B = 128, 256, 512, 1024
    "llama-13b": (1, [4.90, 8.12, 9.08, 10.06]),
    "llama-33b": (2, [5.94, 9.31, 11.56, 12.53]),
    "llama-65b": (4, [7.55, 11.78, 13.92, 15.90]),
}


@pytest.mark.parametrize("name", list(TABLE3))
def test_table3_min_interconnect_bandwidth_within_15_percent(name):
    tp, paper = TABLE3[name]
    m = PRESETS[name]
    ours = [min_interconnect_bandwidth(m, A100, b, paper_mfu(tp), tp) / 1e9 for b in (128, 256, 512, 1024)]
    for b, o, p in zip((128, 256, 512, 1024), ours, paper):
        assert o == pytest.approx(p, rel=0.15), f"{name} B={b}: ours {o:.2f} GB/s, paper {p}"
    assert max(ours) < 20  # "does not exceed 20GB/s"
    # compute-bound at every batch here, so it is exactly the paper's closed form 2edL*F*MFU/N
    closed = paper_min_bandwidth(2, m.hidden, m.layers, m.active_params, tp * A100.flops, paper_mfu(tp)(1024))
    assert ours[-1] == pytest.approx(closed / 1e9)


A40 = Device("A100-40G", "gpu", 17_500, 40, 1555, 312, 200, roles=("compute",))
MEM_3090 = Device("A100-40G@3090-price", "gpu", 40 * 1600 / 24, 40, 1555, 312, 200, roles=("memory",))
CONTEXTS = [512, 1024, 2048, 4096, 8192, 16384]


def fig13_ratios(name: str) -> list[float]:
    m = PRESETS[name]
    tp = 1 if name == "llama-13b" else 2
    a = Assumptions(mfu=paper_mfu(tp))
    out = []
    for c in CONTEXTS:
        base = best_homogeneous(m, A40, c, a)  # vLLM: A100-40G only, best TP 1..8
        off = best_per_dollar(m, A40, MEM_3090, c, a=a)  # Lamina: one replica + memory devices
        out.append(off.per_dollar / base.per_dollar)
    return out


def test_fig13_shape_offloading_wins_and_grows_with_context():
    """Paper: 1.48x-12.1x higher throughput per dollar than vLLM (LLaMA-13B and -33B), the
    margin widest at long contexts. Ours (stated inputs): 13B 1.13x -> 3.25x, 33B 0.96x ->
    9.97x over 512..16384 tokens (33B at 512 tokens is parity, not the paper's >= 1.48x)."""
    r13, r33 = fig13_ratios("llama-13b"), fig13_ratios("llama-33b")
    for r in (r13, r33):
        assert all(x > 0.9 for x in r) and all(x > 1.0 for x in r[1:]), r  # wins from 1024 tokens
        assert all(b > a for a, b in zip(r, r[1:])), r  # and the margin grows with context
    assert min(r13 + r33) < 1.6  # short contexts: a modest gain (paper's low end 1.48x)
    assert 6 < max(r13 + r33) < 20  # long contexts: an order of magnitude (paper's high end 12.1x)
    assert r33[-1] > r13[-1]  # the larger model gains more (less KV room on its devices)


TABLE3_DEVICES = {name: tp for name, (tp, _) in TABLE3.items()}


def whole_batch(mfu, microbatches: int = 2):
    """The MFU curve seen by one of ``microbatches`` micro-batches when the dense part is
    credited with the MFU of the whole batch (the ideal pipeline of the paper's §4.1 analysis)."""
    return lambda b: mfu(microbatches * b)


def fig1_ratio(name: str, context: int, alpha: float = 3.27) -> float:
    """Fig. 1 (Lamina §4.1): offloaded over homogeneous tokens/s/$, A100-80G compute.

    Inputs Fig. 1 does not publish, stated here:
    * devices per model: Table 3's (13B on 1, 33B on 2, 65B on 4 A100s, tensor parallel), for
      the homogeneous cluster and for the compute side of the offloaded one alike;
    * memory devices: A100 capacity and bandwidth at 1/alpha of its price (§4.1), bought in
      eighths so the ratio of the two kinds is enumerated finely; 90 % of memory usable;
    * MFU: this file's curve; the offloaded dense part runs at the whole batch's MFU and
      overlaps attention completely (step = the slower of the two), the homogeneous one runs
      dense then attention (times add).
    """
    m, tp = PRESETS[name], TABLE3_DEVICES[name]
    pool = Device("A100/alpha", "gpu", A100.price_usd / alpha / 8, A100.memory_gb / 8,
                  A100.mem_bw_gbps / 8, A100.bf16_tflops / 8, A100.nic_gbps, roles=("memory",))
    off = best_per_dollar(m, A100, pool, context, a=Assumptions(mfu=whole_batch(paper_mfu(tp))), tp=tp)
    base = homogeneous(m, A100, tp, context, Assumptions(mfu=paper_mfu(tp)), tp=tp)
    return off.per_dollar / base.per_dollar


def test_fig1_advantage_grows_with_context():
    for name in TABLE3_DEVICES:
        r = [fig1_ratio(name, c) for c in (512, 2048, 4096, 16384)]
        assert all(b > a for a, b in zip(r, r[1:])) and r[-1] > 5, (name, r)


@pytest.mark.parametrize("name", ["llama-13b", "llama-33b"])
def test_fig1_2_1_to_2_8x_at_context_512(name):
    """Paper: 2.1x-2.8x at context 512 with alpha = 3.27. Fig. 1 does not name its models; these
    are the two the paper evaluates (§6). Ours: 13B 2.11x, 33B 2.08x (65B, Table 3's third
    model: 1.67x, below; see the next test). When the homogeneous baseline may use 1..8 A100s,
    more KV room lifts it and the ratios drop to 1.58x / 1.30x / 1.17x: Fig. 1's 2.1x needs
    the baseline on Table 3's device counts."""
    assert 2.1 * 0.85 <= fig1_ratio(name, 512) <= 2.8 * 1.15


def test_fig1_llama65b_below_the_published_range():
    """The 65B model, on 4 A100s both ways, gains less at context 512 (its homogeneous
    deployment has relatively more KV room): 1.67x, under Fig. 1's 2.1x low end."""
    assert 1.5 < fig1_ratio("llama-65b", 512) < fig1_ratio("llama-33b", 512)
