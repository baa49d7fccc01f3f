"""Process titles: each Lamina process names its role in ``ps`` / ``top``
(``lamina: server``, ``lamina: replica 0``, ``lamina: memory node 1``).

Uses ``setproctitle`` (rewrites the command line ``ps aux`` shows); where that package is
missing (e.g. a lent GPU machine without it) only the kernel's 15-character thread name is set
(``prctl(PR_SET_NAME)``, what ``ps -e`` and ``top`` show).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import threading
import time
from typing import Callable

_PR_SET_NAME = 15


def set_title(title: str) -> None:
    """Name this process ``title`` (best effort: a title is never worth an error)."""
    try:
        import setproctitle
    except ImportError:
        setproctitle = None
    if setproctitle is not None:
        setproctitle.setproctitle(title)
        return
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        libc.prctl(_PR_SET_NAME, ctypes.c_char_p(title.encode()[:15]), 0, 0, 0)
    except (OSError, AttributeError):
        pass


def keep_title(title: str, interval: float = 1.0,
               setter: Callable[[str], None] = set_title) -> None:
    """Set ``title`` now and re-assert it every ``interval`` seconds from a daemon thread, with
    ``setter``: a Ray worker owns its process title (through its own ``setproctitle``, which
    the pip package cannot override) and renames it around every actor call."""
    def loop() -> None:
        while True:
            time.sleep(interval)
            setter(title)

    setter(title)
    threading.Thread(target=loop, name="lamina-title", daemon=True).start()
