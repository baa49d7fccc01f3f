"""Transport test fixtures: a session-end check that no shared-memory segment or doorbell FIFO
created by this process survives (named ``lamina_<creator pid>_<random>_ab|_ba`` and
``..._ab|_ba.data|.space``, all in /dev/shm by default), and a per-test
watchdog that turns a hang into tracebacks and an exit instead of a stalled run."""
from __future__ import annotations

import faulthandler
import gc
import glob
import os

import pytest


def leaked_segments() -> list[str]:
    return sorted(glob.glob(f"/dev/shm/lamina_{os.getpid()}_*"))


@pytest.fixture(scope="session", autouse=True)
def no_leaked_shm_segments():
    yield
    gc.collect()
    assert leaked_segments() == [], "shared-memory segments leaked by the transport tests"


@pytest.fixture(autouse=True)
def hang_watchdog():
    faulthandler.dump_traceback_later(180, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()
