"""The CUDA half of ``bench/kernels.py`` (``--device cuda``): Triton paged decode attention
vs SDPA on a contiguous copy (no paging) vs ``torch_batched``, at 32 q / 8 kv heads, head_dim
128, bfloat16, over batch 1..256 x context 512..32k; the same call repeated, all methods and a
plain copy of the KV's size timed in the same rounds. ``mbu``: KV bytes/s over the device's
spec bandwidth (:func:`device_peak_bw`), the target of issue 22 (>= 85 % on H100). Each round
times ``BACK_TO_BACK`` calls with one synchronisation at the end (consecutive layers of a decode
step); Triton gets host indptrs, as a memory node's calls do, so it plans once (the first
warm-up call) and every later call reuses the plan, as a step's later layers do; its host work
overlaps the previous call's kernels and small cells measure the per-call host cost.
``triton_graph`` is the same kernel replayed from a CUDA graph per padded shape
(:mod:`lamina.kernels.triton_graphs`: the memory node's default on a GPU); ``host_us`` is a
call's host time (the loop's time before its synchronisation, per call).

``triton_int8`` / ``triton_fp8_e4m3`` / ``triton_k16v8``: the same Triton call over the pool
stored in that KV format (:mod:`lamina.kernels.kv_format`, scales per token and KV head); their
bytes are what they read (codes and scales), and ``vs_bf16`` is their tokens/s over bfloat16's
``triton`` in the same rounds (issue 46's 8-bit row). ``dev_us`` / ``dev_mbu``: the kernel's
time on the device alone: the stream is held by ``torch.cuda._sleep`` while the host queues
``BACK_TO_BACK`` calls, and CUDA events bracket only the calls, so host cost between launches
is hidden (``host_ahead`` says whether the queueing finished inside the hold; where it did not,
the device time includes host gaps).
"""
from __future__ import annotations

import statistics
import time

import torch

from lamina.kernels import paged_attention_batched
from lamina.kernels.kv_format import kv_format
from lamina.types import AttentionSpec

SHAPE = (32, 8, 128, torch.bfloat16)  # q heads, kv heads, head_dim, dtype (LLaMA-3-8B-like)
BACK_TO_BACK = 10  # calls per timed round, one sync at the end: a layer after layer as in decode
CUDA_GRID = [(b, c) for b in (1, 8, 32, 64, 128, 256) for c in (512, 2048, 8192, 32768)]
FORMATS = ("int8", "fp8_e4m3", "k16v8")  # 8-bit KV formats timed beside bfloat16
HOLD_S = 0.03  # the stream hold under the device-time rounds (the host queues inside it)


def _hold_cycles() -> int:
    """``torch.cuda._sleep`` cycles that hold the stream ~HOLD_S (calibrated once)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1000)  # warm
    start.record()
    torch.cuda._sleep(10_000_000)
    end.record()
    torch.cuda.synchronize()
    return int(10_000_000 * HOLD_S / (start.elapsed_time(end) / 1e3))


def format_pools(kp: torch.Tensor, vp: torch.Tensor, name: str) -> tuple:
    """The pools ``kp``/``vp`` ([S, Hkv, D]) stored in KV format ``name``: ``(k codes, v codes,
    k_scale | None, v_scale | None, bytes a call reads)``."""
    fmt = kv_format(name)
    (kq, ks), (vq, vs) = fmt.k.quantize(kp), fmt.v.quantize(vp)
    S, hkv, d = kp.shape
    return fmt.k.view(kq), fmt.v.view(vq), ks, vs, S * hkv * fmt.bytes_per_token_head(d)


def device_time(fn, cycles: int) -> tuple[float, bool]:
    """(seconds per call on the device, whether the host queued all calls inside the hold)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    torch.cuda._sleep(cycles)
    start.record()
    t0 = time.perf_counter()
    for _ in range(BACK_TO_BACK):
        fn()
    queued = time.perf_counter() - t0
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / BACK_TO_BACK, queued < 0.9 * HOLD_S


def _sdpa_padded(q, kc, vc, spec):
    """Torch SDPA over a contiguous [B, Hkv, ctx, D] copy of the KV (unpaged baseline)."""
    qh, sdpa = q[:, :, None, :], torch.nn.functional.scaled_dot_product_attention
    try:
        sdpa(qh, kc, vc, scale=spec.scale, enable_gqa=True)
        return lambda: sdpa(qh, kc, vc, scale=spec.scale, enable_gqa=True)
    except (TypeError, RuntimeError):  # older torch: expand KV heads explicitly
        k2, v2 = kc.repeat_interleave(spec.group_size, 1), vc.repeat_interleave(spec.group_size, 1)
        return lambda: sdpa(qh, k2, v2, scale=spec.scale)


def device_peak_bw() -> float | None:
    """The GPU's spec memory bandwidth in bytes/s (2 x memory clock x bus width, from cupy's
    device properties), or None without cupy."""
    try:
        import cupy
        props = cupy.cuda.runtime.getDeviceProperties(torch.cuda.current_device())
        return 2 * props["memoryClockRate"] * 1e3 * props["memoryBusWidth"] / 8
    except Exception:  # noqa: BLE001 - MBU is then reported against the copy only
        return None


def run_cuda(grid: list[tuple[int, int]], warmup: int, reps: int) -> list[dict]:
    """Triton vs SDPA on a contiguous copy vs torch_batched; the same call repeated. ``mbu``:
    KV bytes/s over the device's spec bandwidth (:func:`device_peak_bw`)."""
    from lamina.kernels.triton_attention import paged_attention_triton
    from lamina.kernels.triton_graphs import paged_attention_graphed
    cycles = _hold_cycles()
    heads, kv_heads, head_dim, dtype = SHAPE
    peak = device_peak_bw()
    free = torch.cuda.mem_get_info()[0]
    rows = []
    for batch, ctx in grid:
        if 9 * 2 * batch * ctx * kv_heads * head_dim * torch.finfo(dtype).bits // 8 > 0.8 * free:
            print(f"batch {batch} ctx {ctx}: skipped (does not fit)", flush=True)
            continue  # pools, contiguous copies, copy probe, 8-bit pools and their quantising
        torch.manual_seed(0)
        spec, S = AttentionSpec(0, heads, kv_heads, head_dim, head_dim ** -0.5), batch * ctx
        kp = torch.randn(S, kv_heads, head_dim, device="cuda", dtype=dtype)
        vp = torch.randn(S, kv_heads, head_dim, device="cuda", dtype=dtype)
        idx = torch.randperm(S).cuda().int()
        q = torch.randn(batch, heads, head_dim, device="cuda", dtype=dtype)
        qo = torch.arange(batch + 1, dtype=torch.int32)
        kv = qo * ctx
        tail = (idx, torch.full((batch,), ctx - 1, dtype=torch.int32, device="cuda"),
                torch.zeros(batch, dtype=torch.int32, device="cuda"), spec)
        args = (q, kp, vp, qo.cuda(), kv.cuda(), *tail)
        host_args = (q, kp, vp, qo, kv, *tail)  # host indptrs: the memory node's planning path
        kc = kp[idx.long()].view(batch, ctx, kv_heads, head_dim).transpose(1, 2).contiguous()
        vc = vp[idx.long()].view(batch, ctx, kv_heads, head_dim).transpose(1, 2).contiguous()
        kv_bytes = 2 * S * kv_heads * head_dim * kp.element_size()
        src = torch.empty(kv_bytes // 4, dtype=torch.float32, device="cuda").normal_()
        dst = torch.empty_like(src)
        fns = {"copy": lambda: dst.copy_(src),
               "triton": lambda: paged_attention_triton(*host_args),
               "triton_graph": lambda: paged_attention_graphed(*host_args),
               "sdpa_padded": _sdpa_padded(q, kc, vc, spec),
               "torch_batched": lambda: paged_attention_batched(*args)}
        nbytes = {n: kv_bytes for n in fns}
        for fname in FORMATS:
            kq, vq, ks, vs, nbytes[f"triton_{fname}"] = format_pools(kp, vp, fname)
            fargs = (q, kq, vq, *host_args[3:])
            fns[f"triton_{fname}"] = (lambda fa=fargs, a=ks, b=vs:
                                      paged_attention_triton(*fa, k_scale=a, v_scale=b))
        times: dict[str, list[float]] = {n: [] for n in fns}
        hosts: dict[str, list[float]] = {n: [] for n in fns}
        devs: dict[str, list[float]] = {n: [] for n in fns if n.startswith(("triton", "sdpa"))}
        ahead: dict[str, bool] = {n: True for n in devs}
        for rnd in range(warmup + reps):
            for name, fn in fns.items():
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(BACK_TO_BACK):
                    fn()
                t1 = time.perf_counter()
                torch.cuda.synchronize()
                if rnd >= warmup:
                    times[name].append((time.perf_counter() - t0) / BACK_TO_BACK)
                    hosts[name].append((t1 - t0) / BACK_TO_BACK)
                if name in devs:
                    dev, ok = device_time(fn, cycles)
                    if rnd >= warmup:
                        devs[name].append(dev)
                        ahead[name] &= ok
        med = {n: statistics.median(ts) for n, ts in times.items()}
        copy_bw = 2 * kv_bytes / med["copy"]
        for name, t in med.items():
            if name != "copy":
                nb = nbytes[name]
                dev = statistics.median(devs[name]) if name in devs else float("nan")
                rows.append(dict(table="grid", threads=0, batch=batch, ctx=str(ctx),
                                 mean_ctx=float(ctx), kind="decode", layers=1, method=name,
                                 kv_mib=nb / 2**20,
                                 time_ms=t * 1e3, gbps=nb / t / 1e9,
                                 host_us=statistics.median(hosts[name]) * 1e6,
                                 copy_gbps=copy_bw / 1e9, frac_copy=nb / t / copy_bw,
                                 mbu=nb / t / peak if peak else float("nan"),
                                 dev_us=dev * 1e6, host_ahead=ahead.get(name, False),
                                 dev_mbu=nb / dev / peak if peak else float("nan"),
                                 vs_bf16=med["triton"] / t,
                                 vs_bf16_dev=(statistics.median(devs["triton"]) / dev
                                              if name in devs else float("nan")),
                                 vs_batched=med["torch_batched"] / t))
        print(f"batch {batch} ctx {ctx}: " + ", ".join(
            f"{r['method']} {r['time_ms']:.3f} ms (device {r['dev_us']:.1f} us)"
            for r in rows if (r["batch"], r["ctx"]) == (batch, str(ctx))), flush=True)
        del kp, vp, kc, vc, src, dst, fns, args
        kq = vq = ks = vs = fargs = None  # the last format's pool
        torch.cuda.empty_cache()
    return rows
