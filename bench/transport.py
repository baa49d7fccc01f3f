"""Round-trip cost of the data path: Lamina's channels vs a raw spin ping-pong, in the same run.

Two processes, pinned to different cores (core 0: this one, core 1: the echo process, when
the host has two): one sends a message holding one float32 tensor of ``size`` bytes, the
other receives it and sends it back; the time of a round trip is the median over batches of
round trips. Payloads 4 KB .. 4 MB. Compared:

* ``raw``: the floor. A shared-memory block with one flag word and one payload area per
  direction; each side copies the payload in (``numpy.copyto``), bumps its flag and spins on
  the other's flag; plain Python spin loops, no framing.
* ``shm spin``: :class:`~lamina.transport.shm.ShmChannel` whose receivers never sleep (what a
  role that owns its core uses: ``spin_us=inf``).
* ``shm brief``: the same with the default 20 us spin, then the doorbell (a role that shares
  its core).
* ``shm spin py``: ``shm spin`` without the C++ fast path (``LAMINA_KERNELS=torch``): the
  ring written and read by Python code, as before the fast path.
* ``tcp``: :class:`~lamina.transport.tcp.TcpChannel` over loopback.

Each channel message is encoded with the wire protocol (header, descriptor, tensor bytes)
and decoded into a fresh tensor on receipt: the cost a memory node's ATTEND and RESULT pay.
``x raw`` is the ratio to the raw round trip of the same size (target: shm spin <= 2.5x at
4 KB and 64 KB).

    python bench/transport.py           # 3 interleaved rounds, ~1 minute
    python bench/transport.py --quick   # smoke run

Writes ``bench/results/transport_cpu.json`` and ``.md``. Never asserts speed.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from multiprocessing import shared_memory
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from lamina.config import KernelConfig, use_kernels  # noqa: E402

SIZES = [4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20]
QUICK_SIZES = [4 << 10, 64 << 10, 1 << 20]
HDR = 128  # bytes before the payload areas: flag a->b at 0, flag b->a at 64


CORES = sorted(os.sched_getaffinity(0))  # read before this process pins itself
ECHO_CORE = CORES[1 % len(CORES)]


def _pin(core: int) -> None:
    """Pin to the ``core``-th core of the host's set (its children inherit the pin, so the echo
    process is told its core explicitly)."""
    os.sched_setaffinity(0, {core})


def _trips(size: int, quick: bool) -> int:
    n = max(20, min(2000, (256 << 20) // (size * 8)))
    return max(10, n // 5) if quick else n


# -- raw spin ping-pong ------------------------------------------------------------------------
def _raw_echo(name: str, size: int, trips: int, core: int) -> None:
    _pin(core)
    shm = shared_memory.SharedMemory(name=name)
    flags = np.ndarray((16,), dtype=np.int64, buffer=shm.buf)
    a = np.ndarray((size,), dtype=np.uint8, buffer=shm.buf, offset=HDR)
    b = np.ndarray((size,), dtype=np.uint8, buffer=shm.buf, offset=HDR + size)
    mine = np.empty(size, dtype=np.uint8)
    for i in range(1, trips + 1):
        while flags[0] != i:
            pass
        np.copyto(mine, a)
        np.copyto(b, mine)
        flags[8] = i
    del flags, a, b
    shm.close()


def raw_round_trip(size: int, trips: int) -> list[float]:
    """Seconds per round trip, per batch of trips (a batch = trips // 10)."""
    shm = shared_memory.SharedMemory(create=True, size=HDR + 2 * size)
    try:
        flags = np.ndarray((16,), dtype=np.int64, buffer=shm.buf)
        flags[:] = 0
        a = np.ndarray((size,), dtype=np.uint8, buffer=shm.buf, offset=HDR)
        b = np.ndarray((size,), dtype=np.uint8, buffer=shm.buf, offset=HDR + size)
        src, dst = np.ones(size, dtype=np.uint8), np.empty(size, dtype=np.uint8)
        p = mp.get_context("spawn").Process(target=_raw_echo,
                                            args=(shm.name, size, trips, ECHO_CORE))
        p.start()
        times, batch, t0 = [], max(1, trips // 10), time.perf_counter()
        for i in range(1, trips + 1):
            np.copyto(a, src)
            flags[0] = i
            while flags[8] != i:
                pass
            np.copyto(dst, b)
            if i % batch == 0:
                t1 = time.perf_counter()
                times.append((t1 - t0) / batch)
                t0 = t1
        p.join(30)
        del flags, a, b
        return times[1:] or times
    finally:
        shm.close()
        shm.unlink()


# -- Lamina channels ---------------------------------------------------------------------------
def _echo(endpoint: dict, spin_us: float, core: int) -> None:
    _pin(core)
    from lamina.transport.endpoint import connect
    from lamina.transport.wire import MsgKind
    ch = connect(endpoint, spin_us=spin_us)
    try:
        while True:
            msg = ch.recv()
            if msg.kind == MsgKind.SHUTDOWN:
                return
            ch.send(msg)
    finally:
        ch.close()


def channel_round_trips(kind: str, spin_us: float, sizes: list[int],
                        quick: bool) -> dict[int, list[float]]:
    import torch

    from lamina.transport.endpoint import listen
    from lamina.transport.wire import Message, MsgKind
    lst = listen(kind, spin_us=spin_us)
    p = mp.get_context("spawn").Process(target=_echo, args=(lst.endpoint, spin_us, ECHO_CORE))
    p.start()
    ch = lst.channel()
    out: dict[int, list[float]] = {}
    try:
        for size in sizes:
            msg = Message(MsgKind.ATTEND, step_id=1, layer=2,
                          tensors=[torch.ones(size // 4, dtype=torch.float32)])
            trips = _trips(size, quick)
            for _ in range(max(5, trips // 10)):  # warm-up
                ch.send(msg)
                ch.recv()
            times, batch, t0 = [], max(1, trips // 10), time.perf_counter()
            for i in range(1, trips + 1):
                ch.send(msg)
                got = ch.recv()
                if i % batch == 0:
                    t1 = time.perf_counter()
                    times.append((t1 - t0) / batch)
                    t0 = t1
            assert got.tensors[0].numel() == size // 4
            out[size] = times
        ch.send(Message(MsgKind.SHUTDOWN))
    finally:
        p.join(30)
        if p.is_alive():
            p.kill()
        ch.close()
    return out


def markdown(rows: list[dict], meta: dict) -> str:
    """Per mode and size: the median over rounds of the round's median round trip, and the
    median over rounds of its ratio to the raw ping-pong measured in the same round."""
    modes = list(dict.fromkeys(r["mode"] for r in rows if r["mode"] != "raw"))
    lines = ["# Data path round trip (one tensor out and back, two pinned processes)", "",
             f"cores: {meta['cores']}; {meta.get('rounds', 1)} round(s), modes interleaved; "
             "median over batches of round trips, then over rounds; `x raw` = that mode's round "
             "trip over the raw spin ping-pong of the same size in the same round (median over "
             "rounds). See the docstring of bench/transport.py.", "",
             "| size | raw us | " + " | ".join(f"{m} us | {m} x raw" for m in modes) + " |",
             "|---:|---:|" + "---:|---:|" * len(modes)]
    for size in sorted({r["size"] for r in rows}):
        us: dict[str, list[float]] = {}
        ratio: dict[str, list[float]] = {}
        raw = {r["round"]: r["us"] for r in rows if r["size"] == size and r["mode"] == "raw"}
        for r in rows:
            if r["size"] == size:
                us.setdefault(r["mode"], []).append(r["us"])
                ratio.setdefault(r["mode"], []).append(r["us"] / raw[r["round"]])
        cells = " | ".join(f"{statistics.median(us[m]):.1f} | {statistics.median(ratio[m]):.1f}x"
                           for m in modes)
        lines.append(f"| {_human(size)} | {statistics.median(us['raw']):.1f} | {cells} |")
    return "\n".join(lines) + "\n"


def _human(n: int) -> str:
    return f"{n >> 20} MB" if n >= 1 << 20 else f"{n >> 10} KB"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="three sizes, fewer trips")
    ap.add_argument("--rounds", type=int, default=3,
                    help="measure every mode this many times, interleaved; report medians")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    a = ap.parse_args(argv)
    _pin(CORES[0])
    sizes = QUICK_SIZES if a.quick else SIZES
    rows: list[dict] = []

    def add(rnd: int, mode: str, size: int, times: list[float]) -> None:
        rows.append(dict(mode=mode, size=size, us=statistics.median(times) * 1e6,
                         batches=len(times), round=rnd))

    from lamina.transport.endpoint import SPIN_US
    modes = (("shm spin", "shm", float("inf")), ("shm brief", "shm", SPIN_US),
             ("shm spin py", "shm", float("inf")), ("tcp", "tcp", SPIN_US))
    for rnd in range(a.rounds):  # every mode once per round: drift hits them alike
        for size in sizes:
            add(rnd, "raw", size, raw_round_trip(size, _trips(size, a.quick)))
        for mode, kind, spin in modes:
            python_ring = mode.endswith(" py")  # the shm ring without its C++ fast path
            old = os.environ.get("LAMINA_KERNELS")
            if python_ring:  # here, and in the spawned echo (which reads it when it starts)
                previous = use_kernels(KernelConfig(ring="python"))
                os.environ["LAMINA_KERNELS"] = "torch"
            try:
                for size, times in channel_round_trips(kind, spin, sizes, a.quick).items():
                    add(rnd, mode, size, times)
            finally:
                if python_ring:
                    use_kernels(previous)
                    if old is None:
                        os.environ.pop("LAMINA_KERNELS", None)
                    else:
                        os.environ["LAMINA_KERNELS"] = old
            print(f"round {rnd + 1} {mode}: " + ", ".join(
                f"{_human(r['size'])} {r['us']:.1f} us" for r in rows
                if r["mode"] == mode and r["round"] == rnd), flush=True)
    meta = dict(cores=[CORES[0], ECHO_CORE], host_cores=os.cpu_count(), quick=a.quick,
                rounds=a.rounds)
    md = markdown(rows, meta)
    print(md)
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "transport_cpu.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    (a.out / "transport_cpu.md").write_text(md)
    print(f"wrote {a.out / 'transport_cpu.json'} and .md")


if __name__ == "__main__":
    main()
