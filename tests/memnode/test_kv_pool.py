"""KVPool: store/gather round trips, views, sizing from byte budgets and free memory."""
from __future__ import annotations

import ctypes
import os
import threading
from pathlib import Path

import numpy as np

import pytest
import torch

from lamina.device import (HUGE_PAGE, advise_huge_pages, huge_page_zeros, populate,
                           wait_populated)
from lamina.memnode.kv_pool import KVPool, available_memory


def test_store_then_views_and_gather_round_trip():
    g = torch.Generator().manual_seed(0)
    pool = KVPool(num_layers=3, num_kv_heads=2, head_dim=4, capacity_slots=16)
    slots = np.array([7, 2, 11, 0])
    k = torch.randn(4, 2, 4, generator=g)
    v = torch.randn(4, 2, 4, generator=g)
    pool.store_kv(1, slots, k, v)
    assert pool.k(1).shape == (16, 2, 4) and pool.k(1).data_ptr() == pool.k_cache[1].data_ptr()
    assert torch.equal(pool.k(1)[torch.from_numpy(slots)], k)
    assert torch.equal(pool.v(1)[torch.from_numpy(slots)], v)
    assert not pool.k(0).any() and not pool.k(2).any()  # other layers untouched
    gk, gv, ks, vs = pool.gather([11, 7], layers=[1])
    assert ks is None and vs is None  # a float pool: no scales
    assert gk.shape == (1, 2, 2, 4)
    assert torch.equal(gk[0], k[[2, 0]]) and torch.equal(gv[0], v[[2, 0]])
    gk[0].zero_()  # gather returns a copy
    assert torch.equal(pool.k(1)[11], k[2])


def test_scatter_gather_all_layers_and_dtype_cast():
    g = torch.Generator().manual_seed(1)
    pool = KVPool(2, 1, 8, 10, torch.bfloat16)
    k = torch.randn(2, 3, 1, 8, generator=g)
    v = torch.randn(2, 3, 1, 8, generator=g)
    slots = torch.tensor([9, 4, 5])
    pool.scatter(slots, k, v)
    gk, gv, _, _ = pool.gather(slots)
    assert gk.dtype == torch.bfloat16 and gk.shape == (2, 3, 1, 8)
    assert torch.equal(gk, k.to(torch.bfloat16)) and torch.equal(gv, v.to(torch.bfloat16))
    assert pool.gather([], layers=range(2))[0].shape == (2, 0, 1, 8)


def test_bad_shapes_and_slots_raise():
    pool = KVPool(2, 2, 4, 8)
    with pytest.raises(ValueError):
        pool.store_kv(0, [1, 2], torch.zeros(2, 2, 5), torch.zeros(2, 2, 5))
    with pytest.raises(IndexError):
        pool.gather([8])
    with pytest.raises(IndexError):
        pool.gather([0], layers=[2])
    with pytest.raises(ValueError):
        pool.scatter([0], torch.zeros(1, 1, 2, 4), torch.zeros(1, 1, 2, 4))  # 1 layer, not 2
    with pytest.raises(ValueError):
        KVPool(0, 2, 4, 8)


def test_capacity_from_byte_budget():
    per = 2 * 4 * 2 * 16 * 4  # K and V, 4 layers, 2 heads, dim 16, float32
    assert KVPool.bytes_per_slot_for(4, 2, 16, torch.float32) == per
    assert KVPool.capacity_for_bytes(per * 100 + per - 1, 4, 2, 16) == 100
    assert KVPool.capacity_for_bytes(per * 100, 4, 2, 16, slab_size=32) == 96
    assert KVPool.capacity_for_bytes(per * 100, 4, 2, 16, torch.bfloat16) == 200
    assert KVPool.capacity_for_bytes(-5, 4, 2, 16) == 0
    pool = KVPool.from_budget(per * 50, 4, 2, 16)
    assert pool.capacity == 50 and pool.nbytes == per * 50
    assert pool.k_cache.numel() * 4 * 2 == pool.nbytes


def test_capacity_from_free_memory():
    free = available_memory("cpu")
    assert free > 0
    per = KVPool.bytes_per_slot_for(1, 1, 8, torch.float32)
    # a tiny fraction of free memory: the pool fits in that share and is non-empty
    pool = KVPool.from_free_memory(1e-6, 1, 1, 8, slab_size=4)
    assert 0 < pool.nbytes <= free * 1e-6 + per and pool.capacity % 4 == 0
    with pytest.raises(ValueError):
        KVPool.from_free_memory(0.0, 1, 1, 8)


def _thp_eligible(addr: int) -> bool | None:
    """The THPeligible flag of the mapping holding ``addr`` (None: the host does not say)."""
    smaps = Path("/proc/self/smaps")
    if not smaps.exists():
        return None
    inside = False
    for line in smaps.read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= addr < hi
        elif inside and head == "THPeligible:":
            return line.split()[1] == "1"
    return None


@pytest.mark.parametrize("commit", ["now", "background", "lazy"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_huge_page_zeros_is_zeroed_writable_and_huge_page_eligible(dtype, commit):
    shape = (2, HUGE_PAGE // 64, 4, 8)  # 2 * 2 MiB / 64 * 32 elements: several huge pages
    t = huge_page_zeros(shape, dtype, commit)
    assert t.shape == shape and t.dtype == dtype and t.is_contiguous()
    assert not t.any()
    t[1, 5] = 3.0
    assert float(t.sum()) == 3.0 * 4 * 8
    mode = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not mode.exists() or "[never]" in mode.read_text():
        pytest.skip("this host has no transparent huge pages")
    assert _thp_eligible(t.data_ptr()) is not False  # advised (or THP always on)


def test_wait_populated_returns_once_background_commits_are_done():
    t = huge_page_zeros((3 * HUGE_PAGE // 4,), torch.float32, "background")
    assert wait_populated(timeout=60)
    assert not any(th.name == "lamina-populate" and th.is_alive() for th in threading.enumerate())
    assert not t.any()


def test_advice_can_come_after_the_writes():
    """``advise=False`` maps without the huge-page advice (writes fault 4 KB pages, no
    compaction); :func:`advise_huge_pages` gives it afterwards, contents kept."""
    t = huge_page_zeros((4 * HUGE_PAGE // 4,), torch.float32, "lazy", advise=False)
    t.fill_(2.0)
    mode = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not mode.exists() or "[madvise]" not in mode.read_text():
        pytest.skip("huge pages here do not depend on the advice")
    inside = -(-t.data_ptr() // HUGE_PAGE) * HUGE_PAGE  # the first whole huge page
    assert _thp_eligible(inside) is False
    assert advise_huge_pages(t)
    assert _thp_eligible(inside) is not False and float(t.sum()) == 2.0 * t.numel()
    assert not advise_huge_pages(t[:10])  # no whole huge page inside


def test_populate_faults_pages_in_without_writing_them():
    t = huge_page_zeros((4 * HUGE_PAGE // 4,), torch.float32, "lazy")
    t[7] = 5.0
    if not populate(t):
        pytest.skip("this kernel cannot populate without writing (Linux < 5.14)")
    assert float(t[7]) == 5.0 and float(t.sum()) == 5.0  # nothing overwritten
    with pytest.raises(ValueError, match="commit"):
        huge_page_zeros((HUGE_PAGE,), torch.float32, "later")


def test_populate_goes_chunk_by_chunk(monkeypatch):
    """Chunks smaller than the tensor, a start inside a page: every chunk populated, nothing
    written (the background form lowers only its own thread's priority)."""
    import lamina.device as device
    monkeypatch.setattr(device, "POPULATE_CHUNK", HUGE_PAGE)
    t = huge_page_zeros((5 * HUGE_PAGE // 4,), torch.float32, "lazy")
    t[-1] = 3.0
    calls = []
    real = ctypes.CDLL(None, use_errno=True).madvise
    monkeypatch.setattr(ctypes, "CDLL", lambda *a, **k: type("L", (), {"madvise": staticmethod(
        lambda addr, size, adv: calls.append(size.value) or real(addr, size, adv))}))
    out, mine = {}, os.getpriority(os.PRIO_PROCESS, 0)

    def run():
        out["ok"] = populate(t[5:], background=True)
        out["nice"] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    worker = threading.Thread(target=run)
    worker.start()
    worker.join()
    if not out["ok"]:
        pytest.skip("this kernel cannot populate without writing (Linux < 5.14)")
    assert len(calls) >= 5 and max(calls) <= HUGE_PAGE
    assert float(t[-1]) == 3.0 and float(t.sum()) == 3.0
    assert out["nice"] == 19 and os.getpriority(os.PRIO_PROCESS, 0) == mine  # that thread only


def test_small_pools_and_the_pool_itself():
    small = huge_page_zeros((3, 4), torch.float32)
    assert small.shape == (3, 4) and not small.any()
    pool = KVPool(2, 3, 64, 4096)  # 3 MiB per cache: huge-page backed where the host allows
    assert pool.k_cache.shape == (2, 4096, 3, 64) and not pool.k_cache.any()
    pool.k_cache[0, 1] = 1.0
    assert float(pool.k(0)[1].sum()) == 3 * 64


@pytest.mark.parametrize("name", ["int8", "fp8_e4m3", "k16v8"])
def test_8bit_pool_stores_quantised_and_moves_as_stored(name):
    """store_kv quantises (the C++ append where it builds: the reference's bytes); gather
    gives the stored bytes and scales; scatter of those into another pool of the format is a
    byte copy, of float values a quantisation."""
    from lamina.kernels.kv_format import kv_format
    fmt = kv_format(name)
    g = torch.Generator().manual_seed(3)
    pool = KVPool(2, 3, 64, 32, name)
    assert pool.k_cache.dtype == fmt.k.storage and pool.v_cache.dtype == fmt.v.storage
    assert (pool.k_scale is None) == (not fmt.k.scaled) and pool.v_scale.shape == (2, 32, 3)
    assert pool.bytes_per_slot == 2 * 3 * fmt.bytes_per_token_head(64)
    slots = np.array([9, 2, 30, 17])
    k, v = torch.randn(4, 3, 64, generator=g), torch.randn(4, 3, 64, generator=g)
    pool.store_kv(1, slots, k, v)
    (kq, ks), (vq, vs) = fmt.k.quantize(k), fmt.v.quantize(v)
    idx = torch.from_numpy(slots)
    assert torch.equal(pool.k_cache[1][idx], kq) and torch.equal(pool.v_cache[1][idx], vq)
    assert torch.equal(pool.scales(1)["v_scale"][idx], vs)
    assert pool.k(1).dtype == fmt.k.dtype  # the kernels' view (float8_e4m3fn for fp8)
    gk, gv, gks, gvs = pool.gather(slots, layers=[1])
    other = KVPool(2, 3, 64, 8, name)
    other.scatter([0, 1, 2, 3], gk, gv, layers=[0], k_scale=gks, v_scale=gvs)
    assert torch.equal(other.v_cache[0][:4], vq) and torch.equal(other.v_scale[0][:4], vs)
    other.scatter([4, 5, 6, 7], k[None], v[None], layers=[1])  # float values: quantised
    assert torch.equal(other.v_cache[1][4:], vq)
    with pytest.raises(ValueError, match="does not fit"):
        KVPool(2, 3, 64, 8, "bfloat16").scatter([0, 1, 2, 3], gk, gv, layers=[0],
                                                k_scale=gks, v_scale=gvs)
