"""What a buyer can order: device, node, network, latency and budget limits for ``lamina plan``.

Units on the command line carry suffixes and are stored in SI: durations in seconds
(``50ms``, ``2s``, ``5us``), bandwidths in bytes/s (``200Gbps`` = 200 Gbit/s = 25e9 B/s,
``25GB/s`` = 25e9 B/s; ``GiB/s`` and ``Mbps`` also parse), money in US dollars.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

_TIME = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "min": 60.0}
_NUM = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([^\s0-9].*?)?\s*$")


def _split(text: str, what: str) -> tuple[float, str]:
    m = _NUM.match(str(text))
    if not m:
        raise ValueError(f"cannot parse {what} {text!r}")
    return float(m.group(1)), (m.group(2) or "").strip()


def parse_duration(text: str | float) -> float:
    """``'50ms'`` -> 0.05 s. A bare number is seconds."""
    if isinstance(text, (int, float)):
        return float(text)
    value, unit = _split(text, "duration")
    scale = _TIME.get(unit.lower()) if unit else 1.0
    if scale is None:
        raise ValueError(f"unknown time unit in {text!r}; use one of ns, us, ms, s, min")
    return value * scale


_BW_UNIT = re.compile(r"^([kKmMgGtT]?)(i?)(b|B|bit)(ps|/s)$")
_PREFIX = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}


def parse_bandwidth(text: str | float) -> float:
    """``'200Gbps'`` -> 2.5e10 B/s; ``'25GB/s'`` -> 2.5e10 B/s. Lower-case ``b`` (or ``bit``)
    means bits, upper-case ``B`` bytes (``Gbps``, ``Gb/s``: bits; ``GBps``, ``GB/s``: bytes);
    ``GiB/s`` is binary. A bare number is bytes/s."""
    if isinstance(text, (int, float)):
        return float(text)
    value, unit = _split(text, "bandwidth")
    if not unit:
        return value
    m = _BW_UNIT.match(unit)
    if not m:
        raise ValueError(f"unknown bandwidth unit in {text!r}; use e.g. 200Gbps, 100Gb/s, 25GB/s")
    prefix, binary, b, _ = m.groups()
    scale = 1024 ** "_kmgt".index(prefix.lower()) if binary and prefix else _PREFIX[prefix.lower()]
    return value * scale / (1 if b == "B" else 8)


def parse_usd(text: str | float) -> float:
    """``'250000'``, ``'$250,000'``, ``'250k'``, ``'1.5M'`` -> US dollars."""
    if isinstance(text, (int, float)):
        return float(text)
    s = str(text).strip().lstrip("$").replace(",", "").replace("_", "")
    mult = {"k": 1e3, "m": 1e6}.get(s[-1:].lower(), 1.0)
    try:
        return float(s[:-1] if mult != 1.0 else s) * mult
    except ValueError:
        raise ValueError(f"cannot parse budget {text!r}; use e.g. 250000, 250k, 1.5M") from None


@dataclass(frozen=True)
class Constraints:
    """Limits every shown plan obeys (None: no limit).

    ``max_devices``: compute + memory devices in total. ``devices_per_node``: accelerator
    slots in one server; a tensor-parallel replica must fit one node, memory GPUs fill the
    slots left beside the compute devices, the rest go to memory-only nodes (a CPU memory
    host is a node of its own). ``nodes``: servers in total. ``nic_bw`` (B/s) and
    ``nic_latency`` (s): the network between nodes, per device (``nic_shared=False``) or one
    NIC per node shared by its devices; None takes each device's catalog ``nic_gbps`` and 0 s.
    ``tbt_slo``/``ttft_slo`` (s): time between tokens / to first token. ``budget_usd``: device
    capex. ``batch``: requests decoded per step over the deployment (None: the planner picks).
    """

    max_devices: int | None = None
    devices_per_node: int = 8
    nodes: int | None = None
    nic_bw: float | None = None
    nic_latency: float = 0.0
    nic_shared: bool = False
    tbt_slo: float | None = None
    ttft_slo: float | None = None
    budget_usd: float | None = None
    batch: int | None = None

    def __post_init__(self) -> None:
        for k in ("max_devices", "nodes", "batch"):
            v = getattr(self, k)
            if v is not None and v < 1:
                raise ValueError(f"{k.replace('_', '-')} must be >= 1, got {v}")
        if self.devices_per_node < 1:
            raise ValueError(f"devices-per-node must be >= 1, got {self.devices_per_node}")
        for k in ("nic_bw", "tbt_slo", "ttft_slo", "budget_usd"):
            v = getattr(self, k)
            if v is not None and not v > 0:
                raise ValueError(f"{k.replace('_', '-')} must be > 0, got {v}")
        if self.nic_latency < 0:
            raise ValueError(f"nic-latency must be >= 0, got {self.nic_latency}")


# names used in messages: the command-line flag that sets each constraint
FLAGS = {"max_devices": "--max-devices", "devices_per_node": "--devices-per-node",
         "nodes": "--nodes", "interconnect": "--nic", "tbt_slo": "--tbt-slo",
         "ttft_slo": "--ttft-slo", "budget_usd": "--budget-usd", "kv_capacity": "KV capacity"}
