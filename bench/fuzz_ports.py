"""Fuzz the data-plane ports of a real memory-node process for a while, with real traffic
going on: 0 crashes, bounded memory, exact replies (issue 20, "Done when").

A memory node runs in a process of its own (``memnode.server.serve_node``, as under
``placement="procs"``) on a tcp primary link: before the node joins, the engine's listener is
attacked; then, round after round until ``--minutes`` are up, the engine has the node OPEN a
tcp peer link (what a compute replica joins under ``transport="tcp"``), throws hostile
connectors at that port (random bytes of random length up to 1 MiB, truncated and forged
handshakes, wire messages without a handshake, silent connectors) and only then connects the
real peer, which sends PREPARE and ATTEND and checks the reply bit for bit against an
in-process MemoryNode. Meanwhile a second, long-lived peer link carries real ATTEND traffic
in a thread (it must never see an error). Every data-plane listener (engine, memory node,
compute replica) is a ``TcpListener`` behind the same handshake, so this covers them all.

Reports rounds, attacks, bytes thrown, connections dropped by the listener, exact replies,
failures, the node process's RSS (first, max, last) and whether it is still alive; writes
bench/results/fuzz_ports.{json,md}. Never asserts anything about speed.

    python bench/fuzz_ports.py --minutes 10
    python bench/fuzz_ports.py --minutes 0.5      # smoke run
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import random
import socket
from dataclasses import asdict
import struct
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import psutil  # noqa: E402
import torch  # noqa: E402

from lamina.memnode import MemoryNode  # noqa: E402
from lamina.memnode.server import node_config, serve_node  # noqa: E402
from lamina.transport import codec  # noqa: E402
from lamina.transport.endpoint import connect, listen  # noqa: E402
from lamina.transport.node_client import RemoteNode  # noqa: E402
from lamina.transport.wire import Message, MsgKind, encode_bytes  # noqa: E402
from lamina.types import AttendMsg, AttentionSpec, PrepareMsg, ShardWork  # noqa: E402

SPEC = AttentionSpec(layer=0, num_heads=2, num_kv_heads=1, head_dim=4, scale=0.5)
RESULTS = ROOT / "bench" / "results"


def _forged_proof(rng: random.Random) -> bytes:
    limits = [rng.choice([0, 1, 8, 64, 1 << 30, 1 << 63, (1 << 64) - 1]) for _ in range(5)]
    return struct.pack("<4sHxx32s32s40s", rng.choice([b"LMNC", b"LMNA", b"\0\0\0\0"]),
                       rng.choice([1, 2, 65535]), rng.randbytes(32), rng.randbytes(32),
                       struct.pack("<5Q", *limits))


def attack_payload(rng: random.Random) -> tuple[str, bytes]:
    kind = rng.choice(["random", "random_big", "forged", "truncated", "wire", "empty"])
    if kind == "random":
        return kind, rng.randbytes(rng.randrange(0, 512))
    if kind == "random_big":
        return kind, rng.randbytes(rng.randrange(512, 1 << 20))
    if kind == "forged":
        return kind, _forged_proof(rng)
    if kind == "truncated":
        return kind, _forged_proof(rng)[:rng.randrange(1, 112)]
    if kind == "wire":
        return kind, encode_bytes(Message(rng.choice(list(MsgKind)), meta={"x": 1},
                                          tensors=[torch.zeros(rng.randrange(0, 64))]))
    return kind, b""


def attack(host: str, port: int, payload: bytes) -> int:
    """One hostile connection; returns the bytes the listener sent back (the HELLO only)."""
    try:
        s = socket.create_connection((host, port), timeout=10)
    except OSError:
        return 0
    got = 0
    try:
        try:
            s.sendall(payload)
            s.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        while True:
            try:
                chunk = s.recv(65536)
            except OSError:
                break
            if not chunk:
                break
            got += len(chunk)
    finally:
        s.close()
    return got


def exact_attend(peer, reply_to: int, seed: int, req: int) -> bool:
    """PREPARE + ATTEND of a fresh request on ``peer``; True when the reply equals an
    in-process MemoryNode's bit for bit."""
    g = torch.Generator().manual_seed(seed)
    n = 1 + seed % 5
    q, k, v = (torch.randn(n, 2, 4, generator=g), torch.randn(n, 1, 4, generator=g),
               torch.randn(n, 1, 4, generator=g))
    works = [ShardWork(req, 0, n, 0, n)]
    peer.send(codec.to_message(PrepareMsg(seed, works)))
    if peer.recv(30).kind != MsgKind.OK:
        return False
    peer.send(codec.to_message(AttendMsg(seed, 0, q, k, v, reply_to=reply_to)))
    res = codec.from_message(peer.recv(30))
    ref = MemoryNode([SPEC], 64, slab_size=4)
    ref.prepare(PrepareMsg(seed, [ShardWork(req, 0, n, 0, n)]))
    want = ref.attend(AttendMsg(seed, 0, q, k, v))
    return torch.equal(res.o, want.o) and torch.equal(res.lse, want.lse)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--attacks-per-round", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=RESULTS)
    a = ap.parse_args(argv)
    rng = random.Random(a.seed)
    stats = dict(rounds=0, attacks=0, attack_bytes=0, hello_only=0, exact=0, failures=0,
                 background_exact=0, background_errors=0, by_kind={})

    primary = listen("tcp")
    host, port = primary.endpoint["host"], int(primary.endpoint["port"])
    config = asdict(node_config([SPEC], 4096, "cpu", torch.float32, 4, num_threads=1))
    proc = mp.get_context("spawn").Process(target=serve_node, args=(primary.endpoint, config),
                                           daemon=True)
    for _ in range(5):  # the engine's own listener, before the node joins
        _, payload = attack_payload(rng)
        attack(host, port, payload)
    proc.start()
    node = RemoteNode(primary.channel(timeout=120), proc, "memory node 0")
    ps = psutil.Process(proc.pid)
    rss = [ps.memory_info().rss]

    stop = threading.Event()
    background = connect(node.open_peer(1, "tcp"))

    def traffic() -> None:  # a long-lived link with real ATTENDs throughout
        i = 0
        while not stop.is_set():
            i += 1
            try:
                ok = exact_attend(background, 1, 10_000 + i, 1_000_000 + i)
                stats["background_exact" if ok else "background_errors"] += 1
                background.send(codec.free_request([1_000_000 + i]))
                background.recv(30)
            except Exception as e:  # noqa: BLE001 - counted, the run goes on
                stats["background_errors"] += 1
                if stats["background_errors"] == 1:
                    print(f"background link: {type(e).__name__}: {e}", flush=True)
            time.sleep(0.01)

    bg = threading.Thread(target=traffic, daemon=True)
    bg.start()
    end = time.monotonic() + a.minutes * 60
    t0 = time.monotonic()
    while time.monotonic() < end and proc.is_alive():
        r = stats["rounds"] = stats["rounds"] + 1
        endpoint = node.open_peer(2, "tcp")
        h, p = endpoint["host"], int(endpoint["port"])
        for _ in range(a.attacks_per_round):
            kind, payload = attack_payload(rng)
            stats["by_kind"][kind] = stats["by_kind"].get(kind, 0) + 1
            stats["attacks"] += 1
            stats["attack_bytes"] += len(payload)
            stats["hello_only"] += attack(h, p, payload) == 80
        if r % 10 == 0:  # a silent connector now and then (held until the handshake deadline)
            silent = socket.create_connection((h, p), timeout=10)
        else:
            silent = None
        try:
            peer = connect(endpoint)
            try:
                ok = exact_attend(peer, 2, r, r)
                stats["exact" if ok else "failures"] += 1
                node.free([r])
            finally:
                peer.close()
        except Exception as e:  # noqa: BLE001 - counted and reported
            stats["failures"] += 1
            print(f"round {r}: {type(e).__name__}: {e}", flush=True)
        finally:
            if silent is not None:
                silent.close()
        rss.append(ps.memory_info().rss)
        if r % 20 == 0:
            print(f"{time.monotonic() - t0:6.0f} s  round {r}  attacks {stats['attacks']}  "
                  f"exact {stats['exact']}  failures {stats['failures']}  "
                  f"node rss {rss[-1] / 2**20:.0f} MiB", flush=True)
    stop.set()
    bg.join(60)
    alive = proc.is_alive()
    background.close()
    node.close()
    proc.join(30)
    if proc.is_alive():
        proc.kill()
    stats.update(seconds=round(time.monotonic() - t0, 1), node_alive_at_end=alive,
                 node_rss_mib=dict(first=round(rss[0] / 2**20, 1), max=round(max(rss) / 2**20, 1),
                                   last=round(rss[-1] / 2**20, 1)))
    md = ["# Data-plane fuzzing (bench/fuzz_ports.py)", "",
          f"{stats['seconds']:.0f} s against a memory-node process's tcp ports, "
          f"{stats['rounds']} rounds (a fresh peer port each), seed {a.seed}.", "",
          "| what | value |", "|---|---:|"]
    for key in ("attacks", "attack_bytes", "hello_only", "exact", "failures", "background_exact",
                "background_errors", "node_alive_at_end"):
        md.append(f"| {key} | {stats[key]} |")
    md.append(f"| node RSS MiB (first / max / last) | {stats['node_rss_mib']['first']} / "
              f"{stats['node_rss_mib']['max']} / {stats['node_rss_mib']['last']} |")
    md.append(f"| attacks by kind | {', '.join(f'{k} {v}' for k, v in sorted(stats['by_kind'].items()))} |")
    text = "\n".join(md) + "\n"
    print(text)
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "fuzz_ports.json").write_text(json.dumps(stats, indent=1))
    (a.out / "fuzz_ports.md").write_text(text)


if __name__ == "__main__":
    main()
