"""Starting ``lamina launch`` as a subprocess for tests, and checking it leaves nothing behind."""
from __future__ import annotations

import contextlib
import signal
import socket
import subprocess
import sys
import time
from typing import Iterator

import psutil


def lamina_processes() -> set[int]:
    """Live (non-zombie) processes of Ray or lamina on this host."""
    found = set()
    for p in psutil.process_iter(["pid", "cmdline", "status"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if p.info["status"] != psutil.STATUS_ZOMBIE and (
                "ray::" in cmd or "raylet" in cmd or "gcs_server" in cmd or "lamina launch" in cmd
                or "ray/dashboard" in cmd or "ray/_private" in cmd or "ray/autoscaler" in cmd):
            found.add(p.info["pid"])
    return found


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def launched(*args: str, stop: signal.Signals = signal.SIGINT) -> Iterator[tuple[int, str]]:
    """Run ``lamina launch ARGS --port P``; yields (P, its readiness line). On exit: ``stop``
    (SIGINT: Ctrl-C), a clean "Lamina stopped", and no Ray or lamina process left behind."""
    before = lamina_processes()
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "lamina.cli", "launch", *args,
                             "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        ready = proc.stdout.readline()  # blocks until the readiness line (or exit)
        assert ready.startswith("Lamina ready: http://127.0.0.1:"), ready
        yield port, ready
    finally:
        proc.send_signal(stop)
        out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0 and "Lamina stopped" in out
    deadline = time.time() + 30
    while lamina_processes() - before and time.time() < deadline:
        time.sleep(0.5)
    assert lamina_processes() - before == set()  # shutdown leaves nothing behind
