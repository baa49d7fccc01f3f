"""The Channel interface every transport backend implements.

A :class:`Channel` is one end of a duplex, ordered, reliable message link between two peers:
``send`` delivers to the peer, ``recv`` returns what the peer sent, in order. Backends:

* ``local`` - same process; the Message object is handed over (no encoding, no copy).
* ``shm``   - same host, separate processes; one shared-memory byte ring per direction.
* ``tcp``   - across hosts: :func:`lamina.transport.wire.encode`'s buffers written with
  ``socket.sendmsg``, read with ``sock.recv_into(StreamDecoder.buffer())``. TCP cannot tell a
  closed peer from a dead one: it reports :class:`PeerDied` only through a ``peer_alive`` hook.

Contract shared by all backends (tested by ``tests/transport/test_conformance.py``):

* ``send(msg)`` returns once the message is handed to the link (local: queued; shm: every byte
  is in the ring; tcp: the kernel took every byte). Messages that break the channel's
  :class:`WireLimits` or hold unsupported data raise :class:`WireError` and are not sent.
  ``send`` never times out; it raises :class:`ChannelClosed` once either side has closed (tcp:
  once this end saw the peer's close - a send racing it may still succeed into the socket
  buffer), :class:`PeerDied` when the peer process is gone while it waits for ring space (tcp:
  when the connection breaks and the hook says so). A send blocks while the link is full (shm:
  the ring; tcp: the socket buffers):
  as with sockets, two peers that both send more than the link holds and receive only
  afterwards deadlock, so receive in another thread (or keep what is in flight small).
* ``recv(timeout=None)`` returns the next message; ``timeout`` (seconds, ``None`` = forever,
  ``0`` = poll) raises ``TimeoutError`` when no whole message arrived in time (a partially
  received message is kept and completed by the next call). It raises :class:`ChannelClosed`
  after the peer closed and everything it sent was received, or after this end was closed;
  :class:`PeerDied` when the peer process died; :class:`WireError` on malformed input (on a
  byte-stream backend this is fatal to the receiving direction: every later ``recv`` raises).
* ``close()`` is idempotent; it wakes a ``recv`` blocked in another thread of this end.
* One thread may send while another receives; concurrent senders are serialised per message.
"""
from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from typing import Callable

from lamina.transport.wire import DEFAULT_LIMITS, Message, MsgKind, WireError, WireLimits

__all__ = ["Channel", "ChannelClosed", "PeerDied", "START_TIMEOUT_S", "REPLY_TIMEOUT_S",
           "serve_loop"]

START_TIMEOUT_S = 300.0  # a role's process (or actor) answers its first PING within this
REPLY_TIMEOUT_S = 600.0  # any request on a channel is answered within this


class ChannelClosed(ConnectionError):
    """The channel was closed (by this end or the peer)."""


class PeerDied(ConnectionError):
    """The peer process is no longer alive."""


class Channel(ABC):
    """One end of a duplex message link. See the module docstring for the contract."""

    limits: WireLimits = DEFAULT_LIMITS

    @abstractmethod
    def send(self, msg: Message) -> None:
        """Deliver ``msg`` to the peer (see the module contract)."""

    @abstractmethod
    def recv(self, timeout: float | None = None) -> Message:
        """Next message from the peer; ``TimeoutError`` after ``timeout`` seconds."""

    @abstractmethod
    def close(self) -> None:
        """Close this end (idempotent)."""

    @property
    @abstractmethod
    def closed(self) -> bool:
        """True once :meth:`close` was called on this end."""

    def exchange(self, kind: MsgKind, step_id: int, layer: int, reply_to: int, tensors: list,
                 reply: MsgKind, spin_ns: int, yield_every: int) -> tuple[int, list | None]:
        """Send a message and take its reply's tensors if that is the next message
        (:meth:`RingChannel.exchange`); here: send, and ``(time.perf_counter_ns(), None)``:
        the reply is :meth:`recv`'s."""
        self.send(Message(kind, step_id, layer, reply_to, tensors=tensors))
        return time.perf_counter_ns(), None

    def native_tx(self) -> tuple[int, int, int, int, int] | None:
        """The send ring for a native writer (:meth:`RingChannel.native_tx`); None: none."""
        return None

    def serve_native(self, serve) -> int | None:
        """Let a native consumer read (:meth:`RingChannel.serve_native`); None: it cannot."""
        return None

    def wait_handle(self) -> tuple[int, int, int] | None:
        """The receive ring for a wait over several (:meth:`RingChannel.wait_handle`); None:
        none (receive with a thread of its own)."""
        return None

    def check_peer(self) -> None:
        """Raise :class:`ChannelClosed` / :class:`PeerDied` as a receive would, where the peer
        closed or died and nothing is left to read (for a waiter that does not call recv)."""

    def __enter__(self) -> "Channel":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def serve_loop(ch: Channel, handler: Callable[[Message], Message],
               on_exit: Callable[[], None] | None = None) -> None:
    """Answer every request on ``ch`` with ``handler``'s one reply, in order, until SHUTDOWN
    (answered, then the loop ends), until the peer is gone, or until the stream is corrupt
    (a :class:`WireError`: logged, since nothing after it can be trusted); then close ``ch``."""
    try:
        while True:
            msg = ch.recv()
            ch.send(handler(msg))
            if msg.kind == MsgKind.SHUTDOWN:
                break
    except (PeerDied, ChannelClosed):
        pass  # the peer is gone: exit quietly
    except WireError as e:
        logging.getLogger("lamina.transport").warning("lamina: closing a corrupt channel: %s", e)
    finally:
        ch.close()
        if on_exit is not None:
            on_exit()
