"""In-process backend: the Message object is handed to the peer through a thread-safe queue.

No encoding and no tensor copy: the receiver gets the sender's tensor objects (same storage,
same device - a CUDA tensor stays on CUDA), so the sender must not modify them after ``send``
(tensors are owned by the sender until the receiver returns; the receiver copies
what it keeps). ``send`` still checks the message against the channel's :class:`WireLimits`
and hands over a JSON round trip of ``meta``, so a message that works here works on every
backend and arrives in the same form.
"""
from __future__ import annotations

import queue
import threading

from lamina.transport.base import Channel, ChannelClosed
from lamina.transport.wire import DEFAULT_LIMITS, Message, WireLimits, check_message

__all__ = ["LocalChannel", "local_pair"]

_PEER_CLOSED = object()  # put on the peer's inbox by close()
_SELF_CLOSED = object()  # put on our own inbox by close() to wake a blocked recv


class LocalChannel(Channel):
    """One end of an in-process link; create pairs with :func:`local_pair`."""

    def __init__(self, inbox: queue.SimpleQueue, outbox: queue.SimpleQueue,
                 link_closed: threading.Event, limits: WireLimits = DEFAULT_LIMITS) -> None:
        self.limits = limits
        self._inbox = inbox
        self._outbox = outbox
        self._link_closed = link_closed  # set by whichever end closes first
        self._closed = False
        self._peer_closed = False
        self._send_lock = threading.Lock()

    @property
    def closed(self) -> bool:
        return self._closed

    def send(self, msg: Message) -> None:
        meta = check_message(msg, self.limits)
        with self._send_lock:
            if self._closed:
                raise ChannelClosed("local channel is closed")
            if self._link_closed.is_set():
                raise ChannelClosed("peer closed the local channel")
            self._outbox.put(Message(msg.kind, msg.step_id, msg.layer, msg.reply_to, meta,
                                     list(msg.tensors)))

    def recv(self, timeout: float | None = None) -> Message:
        if self._closed:
            raise ChannelClosed("local channel is closed")
        if self._peer_closed:
            raise ChannelClosed("peer closed the local channel")
        try:
            if timeout is not None and timeout <= 0:
                item = self._inbox.get(block=False)
            else:
                item = self._inbox.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"no message within {timeout} s") from None
        if item is _SELF_CLOSED or self._closed:
            raise ChannelClosed("local channel is closed")
        if item is _PEER_CLOSED:
            self._peer_closed = True
            raise ChannelClosed("peer closed the local channel")
        return item

    def close(self) -> None:
        with self._send_lock:
            if self._closed:
                return
            self._closed = True
            self._link_closed.set()
            self._outbox.put(_PEER_CLOSED)
            self._inbox.put(_SELF_CLOSED)


def local_pair(limits: WireLimits = DEFAULT_LIMITS) -> tuple[LocalChannel, LocalChannel]:
    """Two connected ends: what one sends, the other receives."""
    a_to_b: queue.SimpleQueue = queue.SimpleQueue()
    b_to_a: queue.SimpleQueue = queue.SimpleQueue()
    link_closed = threading.Event()
    return (LocalChannel(b_to_a, a_to_b, link_closed, limits),
            LocalChannel(a_to_b, b_to_a, link_closed, limits))
