"""Transport: the wire protocol and the channel backends.

* :mod:`~lamina.transport.wire`  - ``Message``, ``MsgKind``, ``encode``/``decode``,
  ``WireLimits``, ``WireError``. No pickle on the data plane. :mod:`~lamina.transport.stream`:
  ``StreamDecoder`` (the same checks, incrementally, for byte streams).
* :mod:`~lamina.transport.endpoint` - ``listen``/``connect``: how roles open and join channels;
  :mod:`~lamina.transport.node_client` - ``NodeClient`` (in-process and remote memory nodes).
* :mod:`~lamina.transport.codec` - ``to_message``/``from_message`` for the dataclasses of
  :mod:`lamina.types` and the request messages (FREE, EXPORT, STATS, OK, ERROR, ...).
* :mod:`~lamina.transport.base`  - the ``Channel`` interface (``send``/``recv``/``close``),
  ``ChannelClosed``, ``PeerDied``.
* backends: :mod:`~lamina.transport.local` (same process, no copy), :mod:`~lamina.transport.shm`
  (same host, shared-memory rings; the spec is plain data), :mod:`~lamina.transport.tcp`
  (across hosts), :mod:`~lamina.transport.rdma` (RDMA WRITE rings, needs pyverbs); every one
  passes ``tests/transport/test_conformance.py``.
"""
from lamina.transport.base import Channel, ChannelClosed, PeerDied
from lamina.transport.codec import RemoteError, from_message, register_error, to_message
from lamina.transport.local import LocalChannel, local_pair
from lamina.transport.shm import ShmChannel, ShmChannelSpec, shm_pair
from lamina.transport.tcp import TcpChannel, TcpListener
from lamina.transport.wire import (DEFAULT_LIMITS, SUPPORTED_DTYPES, Message, MsgKind, WireError,
                                   WireLimits, decode, encode, encode_bytes)
from lamina.transport.stream import StreamDecoder

__all__ = ["Channel", "ChannelClosed", "PeerDied", "RemoteError", "from_message",
           "register_error", "to_message", "LocalChannel", "local_pair", "ShmChannel",
           "ShmChannelSpec", "shm_pair", "TcpChannel", "TcpListener", "DEFAULT_LIMITS",
           "SUPPORTED_DTYPES", "Message", "MsgKind", "StreamDecoder", "WireError", "WireLimits", "decode", "encode",
           "encode_bytes"]
