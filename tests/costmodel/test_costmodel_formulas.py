"""Cost-model arithmetic against values computed by hand for a made-up model and devices.

Model "round": L=10, d=1000, H=10, Hkv=5, D=100, ffn=2000, V=1000, e=2, untied.
  q_dim = H*D = 1000, kv_dim = Hkv*D = 500
  layer params = d*q + 2*d*kv + q*d + 3*d*ffn = 1e6 + 1e6 + 1e6 + 6e6 = 9e6
  active params (layers + LM head) = 10*9e6 + 1000*1000 = 91e6 -> 182e6 FLOP per token
  stored params = 90e6 + 2*1e6 (embedding + LM head) = 92e6 -> 184e6 weight bytes
  KV per token = 2 * L * kv_dim * e = 2*10*500*2 = 20_000 B
  transfer per token = L * e * (2*q_dim + 2*kv_dim) = 10*2*(2000+1000) = 60_000 B
Compute device C: 100 TFLOP/s, 1000 GB/s, 10 GB, 400 Gbit/s (= 5e10 B/s), $10,000.
Memory device M: 10 TFLOP/s, 500 GB/s, 4 GB, 40 Gbit/s (= 5e9 B/s), $1,000.
"""
from __future__ import annotations

import pytest

from lamina.costmodel.model import (Assumptions, Infeasible, MfuCurve, ModelSpec, attn_time, device_ratio,
                              homogeneous, layer_times, min_interconnect_bandwidth, nonattn_time,
                              offloaded, paper_min_bandwidth, tp_degree)
from lamina.costmodel.hardware import Device

ROUND = ModelSpec("round", layers=10, hidden=1000, heads=10, kv_heads=5, head_dim=100,
                  intermediate=2000, vocab=1000, dtype_bytes=2)
C = Device("C", "gpu", 10_000, 10, 1000, 100, 400)
M = Device("M", "gpu", 1_000, 4, 500, 10, 40)
A = Assumptions(mfu=0.5, max_batch=100, usable_memory=1.0, microbatches=2)


def test_model_counts():
    assert ROUND.layer_params == 9_000_000
    assert ROUND.active_params == 91_000_000
    assert ROUND.flops_per_token == 182_000_000
    assert ROUND.params == 92_000_000 and ROUND.weight_bytes == 184_000_000
    assert ROUND.kv_bytes_per_token == 20_000
    assert ROUND.transfer_bytes_per_token == 60_000
    tied = ModelSpec("t", 10, 1000, 10, 5, 100, 2000, 1000, tie_embeddings=True)
    assert tied.params == 91_000_000  # one shared embedding / LM head matrix


def test_device_units():
    assert C.flops == 1e14 and C.mem_bw == 1e12 and C.memory_bytes == 1e10
    assert C.nic_bw == 5e10  # 400 Gbit/s / 8


def test_nonattn_time_compute_and_weight_bound():
    # B=100: FLOPs 100*182e6 = 1.82e10 at 0.5*1e14 -> 3.64e-4 s; weights 182e6 B / 1e12 = 1.82e-4 s
    assert nonattn_time(ROUND, C, 100, 0.5) == pytest.approx(3.64e-4)
    # B=10: FLOPs 1.82e9 / 5e13 = 3.64e-5 s < weights 1.82e-4 s -> weight-bandwidth bound
    assert nonattn_time(ROUND, C, 10, 0.5) == pytest.approx(1.82e-4)
    # curve: MFU(100) = 0.5 * 100 / (100 + 100) = 0.25 -> 1.82e10 / 2.5e13 = 7.28e-4 s
    assert MfuCurve(0.5, 100)(100) == pytest.approx(0.25)
    assert nonattn_time(ROUND, C, 100, MfuCurve(0.5, 100)) == pytest.approx(7.28e-4)
    # two devices sharing the weights halve both terms
    assert nonattn_time(ROUND, C, 100, 0.5, n_devices=2) == pytest.approx(1.82e-4)


def test_attn_time():
    # KV read = 100 * 1000 * 20_000 = 2e9 B at 5e11 B/s = 4e-3 s
    # FLOP floor = 100 * 4 * L*H*D * c = 100 * 4 * 10*10*100 * 1000 = 4e9 at 1e13 = 4e-4 s
    assert attn_time(ROUND, M, 100, 1000) == pytest.approx(4e-3)
    assert attn_time(ROUND, M, 100, 1000, n_devices=4) == pytest.approx(1e-3)
    assert attn_time(ROUND, M, 100, 1000, bw_efficiency=0.5) == pytest.approx(8e-3)


def test_layer_times():
    # per layer: max(2*100*9e6 / 5e13, 2*9e6 / 1e12) = max(3.6e-5, 1.8e-5); attention 4e-3 / 10
    t_m, t_a = layer_times(ROUND, C, M, 100, 1000, 0.5)
    assert t_m == pytest.approx(3.6e-5) and t_a == pytest.approx(4e-4)


def test_min_bandwidth_by_hand_and_paper_formula():
    # 100 tokens * 60_000 B in 3.64e-4 s -> 6e6 / 3.64e-4 = 1.648...e10 B/s
    assert min_interconnect_bandwidth(ROUND, C, 100, 0.5) == pytest.approx(6e6 / 3.64e-4)
    # multi-head variant: transfer = 4*e*d*L = 80_000 B/token; layer params 10e6; N = 101e6
    mha = ModelSpec("mha", 10, 1000, 10, 10, 100, 2000, 1000)
    assert mha.transfer_bytes_per_token == 4 * 2 * 1000 * 10
    # t_m(100) = 100*202e6 / 5e13 = 4.04e-4 s -> 8e6 / 4.04e-4 = 1.980198e10 B/s
    by_hand = 8e6 / 4.04e-4
    assert min_interconnect_bandwidth(mha, C, 100, 0.5) == pytest.approx(by_hand)
    # Lamina: 2*e*d*L*F*MFU/N = 2*2*1000*10*1e14*0.5 / 101e6 -- B cancels
    assert paper_min_bandwidth(2, 1000, 10, 101e6, 1e14, 0.5) == pytest.approx(by_hand)
    assert min_interconnect_bandwidth(mha, C, 1000, 0.5) == pytest.approx(by_hand)


def test_device_ratio_by_hand():
    # t_c = 2 micro-batches * t_m(50) = 2 * max(50*182e6/5e13, 1.82e-4) = 3.64e-4 s
    # capacity: 100*1000*20_000 = 2e9 B over 4e9 per device -> 1
    # bandwidth: attention on one device 4e-3 s / 3.64e-4 = 10.99 -> 11
    # network: 100*60_000 = 6e6 B / (5e9 B/s * 3.64e-4 s = 1.82e6 B) = 3.3 -> 4
    r = device_ratio(ROUND, C, M, 100, 1000, a=A)
    assert (r.for_capacity, r.for_bandwidth, r.for_network, r.n_memory) == (1, 11, 4, 11)
    assert r.t_compute == pytest.approx(3.64e-4) and r.ratio == 11
    # 100x longer context: KV 2e11 B / 4e9 = 50 devices; bandwidth 0.4 s / 3.64e-4 = 1099 -> 1099
    r = device_ratio(ROUND, C, M, 100, 100_000, a=A)
    assert (r.for_capacity, r.for_bandwidth) == (50, 1099)


def test_offloaded_by_hand():
    # 11 memory devices: t_c = 3.64e-4, t_a = 4e-3/11 = 3.636e-4, t_net = 6e6 / min(5e10, 5.5e10) = 1.2e-4
    e = offloaded(ROUND, C, M, 1, 11, 1000, A)
    assert e.batch == 100 and e.batch_limit == "max batch"
    assert (e.t_compute, e.t_attention, e.t_network) == pytest.approx((3.64e-4, 4e-3 / 11, 1.2e-4))
    assert e.step_time == pytest.approx(3.64e-4) and e.bottleneck == "compute"
    assert e.throughput == pytest.approx(100 / 3.64e-4)
    assert e.cost_usd == 21_000 and e.per_dollar == pytest.approx(100 / 3.64e-4 / 21_000)
    # 10 memory devices: attention 4e-4 s is now the slowest resource
    e = offloaded(ROUND, C, M, 1, 10, 1000, A)
    assert e.bottleneck == "attention" and e.throughput == pytest.approx(100 / 4e-4)
    # one micro-batch: nothing overlaps, times add: t_m(100) + 4e-3/11 + 1.2e-4
    e = offloaded(ROUND, C, M, 1, 11, 1000, Assumptions(mfu=0.5, max_batch=100, usable_memory=1.0, microbatches=1))
    assert e.step_time == pytest.approx(3.64e-4 + 4e-3 / 11 + 1.2e-4)


def test_offloaded_kv_capacity_limits_batch():
    # c = 1e5: 2e9 B per request; one 4 GB device holds 2 requests
    e = offloaded(ROUND, C, M, 1, 1, 100_000, A)
    assert e.batch == 2 and e.batch_limit == "KV capacity"
    with pytest.raises(Infeasible, match="holds KV for 0 requests"):
        offloaded(ROUND, C, M, 1, 1, 300_000, A)  # 6e9 B per request > 4e9


def test_homogeneous_by_hand():
    # KV room = 10e9 - 184e6 = 9.816e9 B -> 490 requests of 2e7 B (c=1000), capped by max_batch 1024
    a = Assumptions(mfu=0.5, max_batch=1024, usable_memory=1.0)
    e = homogeneous(ROUND, C, 1, 1000, a)
    assert e.batch == 490 and e.batch_limit == "KV capacity"
    # t_m = 490*182e6 / 5e13 = 1.7836e-3; t_a = 490*1000*20_000 / 1e12 = 9.8e-3; times add
    assert e.t_compute == pytest.approx(1.7836e-3) and e.t_attention == pytest.approx(9.8e-3)
    assert e.step_time == pytest.approx(1.7836e-3 + 9.8e-3) and e.bottleneck == "attention"
    assert e.throughput == pytest.approx(490 / (1.7836e-3 + 9.8e-3))
    # three devices = three replicas (weights fit one device)
    assert homogeneous(ROUND, C, 3, 1000, a).throughput == pytest.approx(3 * e.throughput)


def test_tp_degree_and_infeasible():
    small = Device("small", "gpu", 100, 0.1, 100, 1, 10)  # 1e8 B: 184e6 B of weights need 2
    a = Assumptions(mfu=0.5, usable_memory=1.0)
    assert tp_degree(ROUND, small, a) == 2 and tp_degree(ROUND, C, a) == 1
    with pytest.raises(Infeasible, match="multiple of 2"):
        offloaded(ROUND, small, M, 1, 4, 100, a)
    assert offloaded(ROUND, small, M, 4, 4, 100, a).n_compute == 4  # two replicas of two
    # homogeneous pair: KV room 2e8 - 1.84e8 = 1.6e7 B -> 8 requests of 100 tokens (2e6 B each)
    assert homogeneous(ROUND, small, 2, 100, a).batch == 8
    with pytest.raises(Infeasible, match="KV room for 0"):
        homogeneous(ROUND, small, 2, 1000, a)  # 2e7 B per request > 1.6e7
    assert homogeneous(ROUND, small, 3, 100, a, tp=3).batch == 58  # (3e8 - 1.84e8) // 2e6
    # offloaded replicas of a chosen size: 4 devices as one replica of 4 share its dense work
    one = offloaded(ROUND, small, M, 4, 4, 100, a, batch=8, tp=4)
    two = offloaded(ROUND, small, M, 4, 4, 100, a, batch=8)  # two replicas of two, 4 each
    assert one.t_compute == pytest.approx(2 * nonattn_time(ROUND, small, 4, 0.5, 4))
    assert two.t_compute == pytest.approx(2 * nonattn_time(ROUND, small, 2, 0.5, 2))
    with pytest.raises(Infeasible, match=r"\(1 asked\)"):
        offloaded(ROUND, small, M, 4, 4, 100, a, tp=1)  # below the weights' minimum


def test_hf_config_dict_and_errors():
    cfg = {"num_hidden_layers": 10, "hidden_size": 1000, "num_attention_heads": 10,
           "num_key_value_heads": 5, "intermediate_size": 2000, "vocab_size": 1000,
           "torch_dtype": "float32", "tie_word_embeddings": True}
    m = ModelSpec.from_hf_config(cfg, name="x")
    assert (m.layers, m.head_dim, m.kv_heads, m.dtype_bytes, m.tie_embeddings) == (10, 100, 5, 4, True)
    with pytest.raises(ValueError, match="vocab_size"):
        ModelSpec.from_hf_config({k: v for k, v in cfg.items() if k != "vocab_size"})
    with pytest.raises(ValueError, match="mixture-of-experts"):
        ModelSpec.from_hf_config({**cfg, "num_local_experts": 8})
    with pytest.raises(ValueError, match="kv_heads"):
        ModelSpec("bad", 1, 8, 3, 2, 4, 8, 8)


def test_kv_dtype_prices_a_token_at_the_pools_bytes():
    """The cost model's table (torch-free) agrees with the pools' formats."""
    from dataclasses import replace

    from lamina.costmodel.model import KV_ELEMENT_BYTES, ModelSpec
    from lamina.kernels.kv_format import kv_format
    m = ModelSpec("m", layers=4, hidden=256, heads=8, kv_heads=2, head_dim=64, intermediate=512,
                  vocab=100, dtype_bytes=4)
    assert m.kv_bytes_per_token == 2 * 4 * 2 * 64 * 4
    for name in KV_ELEMENT_BYTES:
        assert replace(m, kv_dtype=name).kv_bytes_per_token == \
            4 * 2 * kv_format(name).bytes_per_token_head(64)
    with pytest.raises(ValueError, match="kv_dtype"):
        replace(m, kv_dtype="int4")
