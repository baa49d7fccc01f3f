"""Peers for the transport tests: an echo service run in a thread, in a spawned process, or in
a process started with ``subprocess`` (``python shm_peers.py '<spec as JSON>'``).

Module-level functions only, so a ``spawn`` child can import them by name (this folder is on
``sys.path`` under pytest's default import mode and the child inherits ``sys.path``).
"""
from __future__ import annotations

import json
import os
import sys
import threading
import time

from lamina.transport import ChannelClosed, MsgKind, PeerDied, ShmChannel
from lamina.transport.base import Channel
from lamina.transport.shm import ShmChannelSpec
from lamina.transport.tcp import TcpChannel


def serve_one(ch: Channel) -> None:
    """Echo every message back, except control PINGs:

    * ``{"inject": hex}`` - write these raw bytes to the stream (malformed-input tests);
    * ``{"close": true}`` - close this end;
    * ``{"exit": code}``  - end the process at once (``os._exit``; spawned peers only);
    * ``{"sleep": s}``    - sleep, then echo.
    Returns when the channel is closed (by either side) or the peer died.
    """
    while True:
        try:
            msg = ch.recv()
        except (ChannelClosed, PeerDied):
            return
        if msg.kind == MsgKind.PING:
            if "inject" in msg.meta:
                ch.send_raw([bytes.fromhex(msg.meta["inject"])])  # type: ignore[attr-defined]
                continue
            if msg.meta.get("close"):
                ch.close()
                return
            if "exit" in msg.meta:
                os._exit(int(msg.meta["exit"]))
            if "sleep" in msg.meta:
                time.sleep(float(msg.meta["sleep"]))
        try:
            ch.send(msg)
        except (ChannelClosed, PeerDied):
            return


def serve_specs(specs: list) -> None:
    """Spawned-process entry: attach every spec and echo on each in its own thread."""
    serve_all([ShmChannel.attach(spec) for spec in specs])


def serve_tcp(host: str, port: int, secret: str, n: int) -> None:
    """Spawned-process entry: open ``n`` connections to ``(host, port)`` and echo on each."""
    serve_all([TcpChannel.connect(host, port, timeout=60, secret=secret) for _ in range(n)])


def serve_all(chans: list) -> None:
    threads = [threading.Thread(target=serve_one, args=(ch,), daemon=True) for ch in chans]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for ch in chans:
        ch.close()


def cpu_seconds(pid: int) -> float:
    """utime + stime of process ``pid`` from /proc (Linux)."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        fields = f.read().rsplit(b")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


if __name__ == "__main__":
    # python shm_peers.py '<spec JSON>': attach to it and echo
    # python shm_peers.py create: create a channel, print its spec as JSON, echo
    if sys.argv[1] == "create":
        channel = ShmChannel.create(1 << 16)
        print(json.dumps(channel.spec.to_dict()), flush=True)
    else:
        channel = ShmChannel.attach(ShmChannelSpec.from_dict(json.loads(sys.argv[1])))
        print("attached", flush=True)
    serve_one(channel)
    channel.close()
