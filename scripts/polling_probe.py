"""Which host calls block while a device-flag wait is pending (GPU only; issue 22 diagnosis).

A replica with device-side polling enqueues a flag wait, then keeps issuing CUDA work from
the same thread before it lands the attention output and moves the flag. Any call that blocks
the host until the wait ends is then a deadlock (until the wait's timeout). For each candidate
call this script enqueues a wait (timeout ``T`` s) on stream A, issues the call, times it,
then moves the flag: a call that took ~T s was blocked by the wait.

    CUDA_MODULE_LOADING=LAZY python scripts/polling_probe.py    # CUDA's default since 12.2
    CUDA_MODULE_LOADING=EAGER python scripts/polling_probe.py   # what a polling replica uses

One line per call; exit 0. On an H100 (torch 2.11, lazy loading) the first matmul (cuBLAS's
kernels not loaded yet), a pageable H2D copy on the waiting stream and a mapped host allocation
(``cudaHostAlloc``) each blocked the host until the wait gave up.
"""
from __future__ import annotations

import os
import sys
import time

import torch

sys.path.insert(0, ".")
from lamina.computenode.device_wait import DeviceFlag, unavailable  # noqa: E402

T = 2.0


def trial(name: str, fn, same_stream: bool = False) -> None:
    flag = DeviceFlag(0)
    a = torch.cuda.Stream()
    b = torch.cuda.Stream()
    torch.cuda.synchronize()
    flag.wait(1, a, timeout_s=T)
    t0 = time.perf_counter()
    err = ""
    try:
        with torch.cuda.stream(a if same_stream else b):
            fn()
    except Exception as e:  # noqa: BLE001
        err = f" error {type(e).__name__}: {e}"
    dt = time.perf_counter() - t0
    flag.set(1)
    torch.cuda.synchronize()
    verdict = "BLOCKED by the wait" if flag.timed_out or dt > T / 2 else "ok"
    print(f"{name:58s} {1e3 * dt:9.1f} ms  {verdict}{err}", flush=True)
    flag.close()


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("polling_probe: torch sees no CUDA device")
    print("device:", torch.cuda.get_device_name(), "| torch", torch.__version__, flush=True)
    print("CUDA_MODULE_LOADING:", os.environ.get("CUDA_MODULE_LOADING", "(unset: lazy)"), flush=True)
    print("unavailable():", unavailable(0), flush=True)
    x = torch.randn(256, 576, device="cuda")
    w = torch.randn(576, 1536, device="cuda")
    torch.cuda.synchronize()
    host = torch.randn(2048, 9, 64)
    size = [1 << 20]

    def fresh_empty():  # a size the caching allocator has not seen: cudaMalloc
        size[0] += 1 << 22
        torch.empty(size[0], dtype=torch.uint8, device="cuda")

    trial("kernel launch (matmul) on stream B", lambda: x @ w)
    trial("kernel launch (matmul) on the waiting stream", lambda: x @ w, same_stream=True)
    trial("torch.empty, new segment (cudaMalloc), stream B", fresh_empty)
    trial("torch.empty, new segment (cudaMalloc), waiting stream", fresh_empty, same_stream=True)
    trial("D2H .cpu() on stream B", lambda: (x @ w).cpu())
    trial("H2D pageable copy on stream B", lambda: host.to("cuda", non_blocking=True))
    trial("H2D pageable copy on stream B + B.synchronize()",
          lambda: (host.to("cuda", non_blocking=True), torch.cuda.current_stream().synchronize()))
    trial("H2D pageable copy on the waiting stream", lambda: host.to("cuda", non_blocking=True),
          same_stream=True)
    trial("torch pinned empty (host caching allocator)",
          lambda: torch.empty(1 << 22, dtype=torch.uint8, pin_memory=True))
    trial("DeviceFlag() (cudaHostAlloc mapped)", lambda: DeviceFlag(0))
    trial("torch.cuda.Stream()", torch.cuda.Stream)

    def new_stream_matmul():
        with torch.cuda.stream(torch.cuda.Stream()):
            return x @ w

    trial("new stream + matmul (cuBLAS workspace)", new_stream_matmul)
    buf = torch.empty(2048, 9, 64, device="cuda")
    pinned = torch.empty(2048, 9, 64, pin_memory=True)
    trial("H2D pinned copy on the waiting stream (polling's staging)",
          lambda: buf.copy_(pinned, non_blocking=True), same_stream=True)
    trial("copy_ into a buffer made before the wait, stream B + sync",
          lambda: (buf.copy_(host, non_blocking=True), torch.cuda.current_stream().synchronize()))


if __name__ == "__main__":
    main()
