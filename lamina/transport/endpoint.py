"""Endpoints: how one role opens a channel that another role (another process, actor or host)
then joins, whatever the backend.

An endpoint is plain data (a dict that travels in a control message or as a process argument):
``{"kind": "shm", "spec": {...}}``, ``{"kind": "tcp", "host": ..., "port": ..., "secret": ...}`` or
``{"kind": "rdma", "host": ..., "port": ..., "secret": ..., "capacity": ...}`` (the tcp listener of
the RDMA setup exchange, :mod:`lamina.transport.rdma`).
It is a capability: whoever holds it can join. A tcp endpoint's ``secret`` is fresh for each
endpoint and proven in the handshake of :mod:`lamina.transport.auth`; an shm endpoint names
segments that only this user can open, whose names are removed as soon as the peer attached.
Endpoints travel only over the control plane (process or actor arguments, replies on an
already joined channel). The side
that opens it calls :func:`listen` and hands ``listening.endpoint`` to the peer, which calls
:func:`connect`; the opener gets its end with :meth:`Listening.channel` (shm: at once; tcp:
once the peer connected). Which backend a link uses is the placement's choice
(:func:`link_kind`): shm between two ends on one host, tcp across hosts, rdma when asked for
(and refused with the reason where it cannot run).
"""
from __future__ import annotations

import threading
from typing import Any

from lamina.transport.base import START_TIMEOUT_S, Channel

KINDS = ("shm", "tcp", "rdma")
RING_BYTES = 8 << 20  # data bytes per direction of a shm channel
SPIN_US = 20.0  # a receiver spins this long before it blocks on its doorbell (default)


class Listening:
    """The opener's side of an endpoint. :meth:`channel` returns the (one) channel, accepting
    the peer's connection the first time for tcp; safe to call from several threads."""

    def __init__(self, endpoint: dict[str, Any], channel: Channel | None = None,
                 listener: Any = None):
        self.endpoint = endpoint
        self._channel = channel
        self._listener = listener
        self._lock = threading.Lock()

    def channel(self, timeout: float = START_TIMEOUT_S) -> Channel:
        with self._lock:
            if self._channel is None:
                try:
                    self._channel = self._listener.accept(timeout=timeout)
                finally:
                    self._listener.close()
            return self._channel

    def close(self) -> None:
        with self._lock:
            if self._channel is not None:
                self._channel.close()
            elif self._listener is not None:
                self._listener.close()


def listen(kind: str = "shm", host: str = "127.0.0.1", *,
           spin_us: float = SPIN_US) -> Listening:
    """Open an endpoint of backend ``kind``; a tcp listener binds ``host`` (loopback unless the
    placement spans hosts)."""
    if kind == "shm":
        from lamina.transport.shm import ShmChannel
        ch = ShmChannel.create(capacity=RING_BYTES, spin_us=spin_us)
        return Listening({"kind": "shm", "spec": ch.spec.to_dict()}, channel=ch)
    if kind == "tcp":
        from lamina.transport.tcp import TcpListener
        lst = TcpListener(host, 0)
        h, port = lst.address
        return Listening({"kind": "tcp", "host": h, "port": port, "secret": lst.secret},
                         listener=lst)
    if kind == "rdma":
        from lamina.transport.rdma import RdmaListener
        rl = RdmaListener(host, RING_BYTES, spin_us)
        h, port = rl.address
        return Listening({"kind": "rdma", "host": h, "port": port, "secret": rl.secret,
                          "capacity": RING_BYTES}, listener=rl)
    raise ValueError(f"unknown channel kind {kind!r}; expected one of {KINDS}")


def connect(endpoint: dict[str, Any], *, spin_us: float = SPIN_US) -> Channel:
    """Join the channel described by ``endpoint`` (from :func:`listen`)."""
    kind = endpoint.get("kind")
    if kind == "shm":
        from lamina.transport.shm import ShmChannel
        return ShmChannel.attach(endpoint["spec"],
                                 spin_us=spin_us)
    if kind == "tcp":
        from lamina.transport.tcp import TcpChannel
        return TcpChannel.connect(endpoint["host"], int(endpoint["port"]),
                                  secret=endpoint["secret"])
    if kind == "rdma":
        from lamina.transport import rdma
        return rdma.connect(endpoint["host"], int(endpoint["port"]), endpoint["secret"],
                            int(endpoint["capacity"]), spin_us=spin_us)
    raise ValueError(f"unknown channel kind {kind!r}; expected one of {KINDS}")


def link_kind(transport: str, server: dict[str, Any], client: dict[str, Any]) -> tuple[str, str]:
    """(backend, bind host) of a link whose opener runs at ``server`` and whose joiner at
    ``client`` (each ``{"node_id", "ip"}``). ``transport``: ``auto`` (shm on one host, else tcp),
    ``shm`` (refused across hosts), ``tcp`` or ``rdma`` (raises
    :class:`~lamina.transport.rdma.RdmaUnavailable` naming what is missing where it cannot run)."""
    same = server["node_id"] == client["node_id"]
    if transport not in ("auto", *KINDS):
        raise ValueError(f"transport must be one of auto, {', '.join(KINDS)}; got {transport!r}")
    if transport == "rdma":
        from lamina.transport.rdma import require
        require()
        return "rdma", "127.0.0.1" if same else server["ip"]
    if transport == "shm" and not same:
        raise ValueError("transport 'shm' needs both ends on one host; use 'auto' or 'tcp'")
    kind = "shm" if transport == "shm" or (transport == "auto" and same) else "tcp"
    return kind, "127.0.0.1" if same else server["ip"]
