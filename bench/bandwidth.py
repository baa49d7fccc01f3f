"""This machine's memory bandwidth as torch reaches it: a copy (STREAM's Copy) and a pure read.

Used by :mod:`bench.peers` to put a batch-1 token beside the time to stream the weights once.
"""
from __future__ import annotations

import time
from functools import partial


def copy_bandwidth(threads: int, mib: int = 512, repeats: int = 5) -> float:
    """Bytes read + written per second by torch ``copy_`` of ``mib`` MiB (STREAM's Copy)."""
    return 2 * _best_rate(threads, mib, repeats, lambda src: partial(src.clone().copy_, src))


def read_bandwidth(threads: int, mib: int = 512, repeats: int = 5) -> float:
    """Bytes read per second by torch ``sum`` of ``mib`` MiB (a pure read, as a weight stream)."""
    return _best_rate(threads, mib, repeats, lambda src: src.sum)


def _best_rate(threads: int, mib: int, repeats: int, make) -> float:
    """Bytes of ``src`` (``mib`` MiB of float32) per second of the best of ``repeats`` calls of
    ``make(src)()`` (one untimed call first), on ``threads`` torch threads."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        src = torch.ones(mib << 18)  # float32: mib MiB
        fn = make(src)
        fn()
        return src.numel() * 4 / min(_timed(fn) for _ in range(repeats))
    finally:
        torch.set_num_threads(before)


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t
