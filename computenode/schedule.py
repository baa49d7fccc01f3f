"""Which compute replica runs which slice of which micro-batch (staggered pipelining, Lamina
§5.1): ``rotational`` moves a micro-batch to the next replica after every slice, ``fixed`` keeps
micro-batch j on replica ``j mod N``, ``none`` is one micro-batch on replica 0."""
from __future__ import annotations

from lamina.config import SCHEDULES


def replica_for(schedule: str, micro_batch: int, slice_index: int, num_replicas: int) -> int:
    """The compute replica that runs slice ``slice_index`` of micro-batch ``micro_batch``."""
    if schedule == "rotational":
        return (micro_batch + slice_index) % num_replicas
    if schedule == "fixed":
        return micro_batch % num_replicas
    if schedule == "none":
        return 0
    raise ValueError(f"unknown pipeline schedule {schedule!r}; expected one of {SCHEDULES}")
