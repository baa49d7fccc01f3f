"""Launch-option sweep of the Triton decode kernel per KV format (GPU only; issue 46).

For each KV format (bfloat16 and the 8-bit ones) and cell (batch x context, 32 q / 8 KV heads,
head_dim 128, random slot permutation), the kernel's device time (the host queues ahead under a
stream hold, :func:`kernels_cuda.device_time`) for each ``num_warps`` x ``num_stages`` x
``block_n`` and, at batch 1, each KV chunk. Prints one line per config and writes
``triton_sweep.json`` (``--out``). Never asserts speed.

    python bench/triton_sweep.py --out /tmp/sweep
"""
from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
for p in (ROOT, ROOT / "bench"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from kernels_cuda import _hold_cycles, device_peak_bw, device_time, format_pools  # noqa: E402
from lamina.kernels.triton_attention import launch  # noqa: E402
from lamina.kernels.triton_plan import _launch_plan  # noqa: E402
from lamina.types import AttentionSpec  # noqa: E402

H, HKV, D = 32, 8, 128


def cell(batch: int, ctx: int, fmts: list[str], slab: int = 1) -> dict:
    """Pools of each format over the same random values and one slot permutation (of runs of
    ``slab`` consecutive slots: the allocator's slabs; 1: every token anywhere)."""
    torch.manual_seed(0)
    S = batch * ctx
    kp = torch.randn(S, HKV, D, device="cuda", dtype=torch.bfloat16)
    vp = torch.randn(S, HKV, D, device="cuda", dtype=torch.bfloat16)
    pools = {name: format_pools(kp, vp, name) for name in fmts}
    del kp, vp
    qo = torch.arange(batch + 1, dtype=torch.int32)
    return dict(pools=pools, q=torch.randn(batch, H, D, device="cuda", dtype=torch.bfloat16),
                qo=qo, kv=qo * ctx,
                idx=(torch.randperm(S // slab, device="cuda")[:, None] * slab
                     + torch.arange(slab, device="cuda")).flatten().int(),
                qpos=torch.full((batch,), ctx - 1, dtype=torch.int32, device="cuda"),
                start=torch.zeros(batch, dtype=torch.int32, device="cuda"))


def time_config(c: dict, name: str, cycles: int, reps: int, kv_chunk: int | None,
                block_n: int | None, tune: dict) -> float:
    kq, vq, ks, vs, _ = c["pools"][name]
    spec = AttentionSpec(0, H, HKV, D, D ** -0.5)
    lp = _launch_plan(c["qo"], c["kv"], c["q"].shape[0], HKV, H // HKV, D, kv_chunk, block_n,
                      torch.device("cuda"))
    o = torch.empty_like(c["q"])
    lse = torch.empty(c["q"].shape[:2], dtype=torch.float32, device="cuda")
    fn = lambda: launch(c["q"], kq, vq, c["idx"], c["qpos"], c["start"], lp, o, lse, spec,  # noqa: E731
                        ks, vs, **tune)
    fn()
    return statistics.median(device_time(fn, cycles)[0] for _ in range(reps))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--formats", nargs="+", default=["bfloat16", "int8", "fp8_e4m3", "k16v8"])
    ap.add_argument("--cells", nargs="+", default=["32x8192", "1x32768"])
    ap.add_argument("--warps", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--stages", type=int, nargs="+", default=[1, 2, 3, 4])
    ap.add_argument("--block-n", type=int, nargs="+", default=[32, 64, 128])
    ap.add_argument("--chunks", type=int, nargs="+", default=[0, 256, 512, 1024, 2048])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--slab", type=int, default=1, help="consecutive slots per run (16: slabs)")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    a = ap.parse_args()
    cycles, peak, rows = _hold_cycles(), device_peak_bw(), []
    for spec in a.cells:
        batch, ctx = map(int, spec.split("x"))
        c = cell(batch, ctx, a.formats, a.slab)
        for name in a.formats:
            nbytes = c["pools"][name][4]
            chunks = a.chunks if batch == 1 else [0]
            for w, st, bn, ch in itertools.product(a.warps, a.stages, a.block_n, chunks):
                try:
                    t = time_config(c, name, cycles, a.reps, ch or None, bn,
                                    dict(num_warps=w, num_stages=st))
                except Exception as e:  # noqa: BLE001 - a config that does not compile
                    print(f"{spec} {name} w{w} s{st} n{bn} c{ch}: {type(e).__name__}", flush=True)
                    continue
                rows.append(dict(cell=spec, slab=a.slab, fmt=name, warps=w, stages=st, block_n=bn, chunk=ch,
                                 us=t * 1e6, mbu=nbytes / t / peak if peak else None))
                print(f"{spec} {name} w{w} s{st} n{bn} c{ch}: {t * 1e6:.1f} us "
                      f"{100 * nbytes / t / peak:.0f}% MBU", flush=True)
        del c
        torch.cuda.empty_cache()
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "triton_sweep.json").write_text(json.dumps(rows, indent=1))
    for spec in a.cells:
        for name in a.formats:
            best = min((r for r in rows if r["cell"] == spec and r["fmt"] == name),
                       key=lambda r: r["us"], default=None)
            if best:
                print("best", best, flush=True)


if __name__ == "__main__":
    main()
