"""Across hosts: the wire protocol over a TCP stream.

``send`` writes :func:`~lamina.transport.wire.encode`'s buffers with ``sendmsg`` (no copy into
one big bytes object); ``recv`` fills a :class:`~lamina.transport.stream.StreamDecoder` with
``recv_into``, so the limits are checked before anything large is allocated (a malformed or
over-limit header raises :class:`~lamina.transport.wire.WireError` and poisons the receiving
direction). ``TCP_NODELAY`` is set: per-layer messages are latency-bound.

A ``send`` blocks until the kernel took every byte, i.e. while the peer does not read a large
message (as with shm's full ring: receive in another thread). A ``recv`` blocks in ``poll``;
``close()`` from another thread shuts the socket down, which wakes it.

End of stream (or a reset) means the peer closed (:class:`ChannelClosed`) - or died
(:class:`PeerDied`) when a ``peer_alive`` hook says so: TCP cannot tell a closed socket from a
dead process, so without a hook it is always :class:`ChannelClosed`. The hook is also polled
every ``wake_interval`` seconds while a ``recv`` waits, which catches a peer whose host went
away without closing the connection; after an end of stream it is polled for up to
``death_grace`` seconds, since a dying process closes its sockets just before it is reaped.

Every connection starts with the authenticated handshake of :mod:`lamina.transport.auth`
(mutual HMAC over a per-listener secret, limits agreed before any allocation): a connector
without the secret gets nothing, and the listener drops it and keeps accepting. Once a
message has begun, the rest must keep arriving: no byte for ``frame_timeout`` seconds
mid-message is a :class:`~lamina.transport.wire.WireError` (a stalled or truncated frame never
blocks a reader for good).

Servers bind to 127.0.0.1 unless told otherwise::

    listener = TcpListener("127.0.0.1", 0)     # server: port 0 picks a free port
    host, port = listener.address              # hand (host, port) and listener.secret to the
                                               # peer over the control plane
    ch = listener.accept(timeout=30)           # server side of the link
    peer = TcpChannel.connect(host, port, secret=secret)   # client side
"""
from __future__ import annotations

import logging
import math
import select
import socket
import threading
import time
from typing import Any, Callable, Sequence

from lamina.transport.auth import (HANDSHAKE_TIMEOUT_S, AuthError, connector_handshake,
                                   listener_handshake, new_secret)
from lamina.transport.base import Channel, ChannelClosed, PeerDied
from lamina.transport.wire import DEFAULT_LIMITS, Buffer, Message, WireError, WireLimits, encode
from lamina.transport.stream import StreamDecoder

__all__ = ["TcpChannel", "TcpListener"]

_IOV_MAX = 512
_MSG_NOSIGNAL = getattr(socket, "MSG_NOSIGNAL", 0)
_MSG_DONTWAIT = getattr(socket, "MSG_DONTWAIT", 0)
_POLL_IN = select.POLLIN | select.POLLPRI | select.POLLHUP | select.POLLERR
FRAME_TIMEOUT_S = 60.0  # most seconds without a byte in the middle of a message
log = logging.getLogger("lamina.transport")


class TcpChannel(Channel):
    """One end of a TCP link (see the module docstring). Build with :meth:`connect` or
    :meth:`TcpListener.accept`, or wrap a connected stream socket.

    ``peer_alive``: optional liveness hook (e.g. a child's ``is_alive``). ``wake_interval``:
    seconds between hook checks while a ``recv`` waits (without a hook it sleeps until data,
    end of stream or ``close``). ``death_grace``: how long to keep asking the hook after an end
    of stream before calling it a close. ``frame_timeout``: most seconds without a byte once
    a message has begun. The socket must have passed the handshake (:meth:`connect` and
    :meth:`TcpListener.accept` run it; ``limits`` are then the agreed ones)."""

    def __init__(self, sock: socket.socket, *, limits: WireLimits = DEFAULT_LIMITS,
                 peer_alive: Callable[[], bool] | None = None, wake_interval: float = 0.25,
                 death_grace: float = 0.25, keepalive_s: float = 60.0,
                 frame_timeout: float = FRAME_TIMEOUT_S) -> None:
        if wake_interval <= 0 or death_grace < 0 or frame_timeout <= 0:
            raise ValueError("wake_interval and frame_timeout must be > 0, death_grace >= 0")
        if sock.type != socket.SOCK_STREAM:
            raise ValueError("a TcpChannel needs a stream socket")
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            # a host that vanishes without closing the connection ends it after ~keepalive_s
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
            for opt, val in (("TCP_KEEPIDLE", keepalive_s / 2), ("TCP_KEEPINTVL", keepalive_s / 8),
                             ("TCP_KEEPCNT", 4)):
                if hasattr(socket, opt):
                    sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, opt), max(1, int(val)))
        sock.setblocking(True)
        self.sock = sock
        self.limits = limits
        self._peer_alive = peer_alive
        self._wake = wake_interval
        self._grace = death_grace
        self._frame_timeout = frame_timeout
        self._dec = StreamDecoder(limits)
        self._poll = select.poll()
        self._poll.register(sock.fileno(), _POLL_IN)
        self._tx_lock = threading.Lock()
        self._rx_lock = threading.Lock()
        self._close_lock = threading.Lock()
        self._closed = False
        self._eof: ConnectionError | None = None  # what the end of the stream meant

    @classmethod
    def connect(cls, host: str, port: int, timeout: float = 30.0, *, secret: str,
                limits: WireLimits = DEFAULT_LIMITS, **kw: Any) -> "TcpChannel":
        """Connect to a :class:`TcpListener` holding ``secret`` (retrying a refused connection
        until ``timeout``) and run the handshake; :class:`~lamina.transport.auth.AuthError`
        when the listener does not prove the secret."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                sock = socket.create_connection(
                    (host, port), timeout=max(0.1, deadline - time.monotonic()))
                break
            except ConnectionRefusedError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        try:
            # the HELLO may come late: the listener handshakes connectors one at a time
            agreed = connector_handshake(sock, secret, limits,
                                         max(HANDSHAKE_TIMEOUT_S, deadline - time.monotonic()))
            return cls(sock, limits=agreed, **kw)
        except BaseException:
            sock.close()
            raise

    # ------------------------------------------------------------------ liveness / state

    @property
    def closed(self) -> bool:
        return self._closed

    def set_peer_alive(self, fn: Callable[[], bool] | None) -> None:
        """Install (or with ``None`` remove) the peer-liveness hook."""
        self._peer_alive = fn

    def peer_alive(self) -> bool:
        """The hook's answer; True without a hook (TCP alone cannot tell)."""
        return self._peer_alive is None or bool(self._peer_alive())

    def _gone(self, why: str) -> ConnectionError:
        """Classify an end of stream / broken connection: PeerDied if the hook says so (asked
        for up to ``death_grace`` seconds), else ChannelClosed. Remembered for later calls."""
        if self._eof is None:
            if self._closed:
                return ChannelClosed("tcp channel is closed")
            exc: ConnectionError = ChannelClosed(f"peer closed the tcp channel ({why})")
            fn = self._peer_alive
            if fn is not None:
                end = time.monotonic() + self._grace
                while True:
                    if not fn():
                        exc = PeerDied(f"tcp peer died ({why})")
                        break
                    if time.monotonic() >= end:
                        break
                    time.sleep(0.005)
            self._eof = exc
        return type(self._eof)(*self._eof.args)

    # ------------------------------------------------------------------ data path

    def send(self, msg: Message) -> None:
        self.send_raw(encode(msg, self.limits))

    def send_raw(self, buffers: Sequence[Buffer]) -> None:
        """Write bytes to the stream unchecked: for forwarding messages already encoded with
        :func:`~lamina.transport.wire.encode` (and for tests that inject malformed input)."""
        bufs = [m for m in (memoryview(b).cast("B") for b in buffers) if len(m)]
        with self._tx_lock:
            if self._closed:
                raise ChannelClosed("tcp channel is closed")
            if self._eof is not None:
                raise self._gone("end of stream")
            try:
                while bufs:
                    n = self.sock.sendmsg(bufs[:_IOV_MAX], [], _MSG_NOSIGNAL)
                    while n:
                        if n >= len(bufs[0]):
                            n -= len(bufs.pop(0))
                        else:
                            bufs[0] = bufs[0][n:]
                            n = 0
            except OSError as e:  # EPIPE, ECONNRESET, EBADF after close, ...
                if self._closed:
                    raise ChannelClosed("tcp channel is closed") from e
                raise self._gone(f"send: {e}") from e

    def recv(self, timeout: float | None = None) -> Message:
        deadline = None if timeout is None else time.monotonic() + max(timeout, 0.0)
        with self._rx_lock:
            last_byte = time.monotonic()
            while True:
                if self._closed:
                    raise ChannelClosed("tcp channel is closed")
                view = self._dec.buffer()  # raises WireError once the stream is corrupt
                if self._eof is not None:
                    raise self._gone("end of stream")
                try:
                    n = self.sock.recv_into(view, len(view), _MSG_DONTWAIT)
                except (BlockingIOError, InterruptedError):
                    n = -1
                except OSError as e:  # ECONNRESET, or EBADF after a close from another thread
                    if self._closed:
                        raise ChannelClosed("tcp channel is closed") from e
                    raise self._gone(f"recv: {e}") from e
                finally:
                    view.release()
                if n == 0:
                    raise self._gone("end of stream")
                if n > 0:
                    last_byte = time.monotonic()
                    msg = self._dec.advance(n)
                    if msg is not None:
                        return msg
                    continue
                # nothing there: wait for readability, the deadline or a hook check
                wait = None if self._peer_alive is None else self._wake
                if self._dec.in_progress:  # mid-message: the rest must keep coming
                    stalled = time.monotonic() - last_byte
                    if stalled >= self._frame_timeout:
                        exc = WireError(f"truncated message: no byte for {stalled:.0f} s "
                                        "in the middle of a message")
                        self._dec.poison(exc)
                        raise exc
                    left = self._frame_timeout - stalled
                    wait = left if wait is None else min(wait, left)
                if deadline is not None:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise TimeoutError(f"no message within {timeout} s")
                    wait = left if wait is None else min(wait, left)
                ready = self._poll.poll(None if wait is None else max(1, math.ceil(wait * 1000)))
                if not ready and self._peer_alive is not None and not self._peer_alive():
                    raise PeerDied("tcp peer died (recv)")

    def close(self) -> None:
        """Close this end: shut the socket down (the peer sees an end of stream after what was
        sent; a recv/send blocked in another thread of this end wakes and raises
        ChannelClosed), then release it once no thread uses it."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        got_tx = self._tx_lock.acquire(timeout=5.0)
        got_rx = self._rx_lock.acquire(timeout=5.0)
        try:
            if got_tx and got_rx:  # nobody inside: the fd cannot be reused under a syscall
                self.sock.close()
        finally:
            if got_tx:
                self._tx_lock.release()
            if got_rx:
                self._rx_lock.release()


class TcpListener:
    """A listening socket; ``accept`` returns one authenticated :class:`TcpChannel` per
    connection. ``secret`` (default: a fresh one, :attr:`secret`) is what connectors must
    prove; hand it to the peer over the control plane with :attr:`address`."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, backlog: int = 16,
                 secret: str | None = None) -> None:
        self.secret = secret or new_secret()
        self.sock = socket.create_server((host, port), backlog=backlog)
        self.address: tuple[str, int] = self.sock.getsockname()[:2]
        self.dropped = 0  # connections that failed the handshake

    def accept(self, timeout: float | None = None, *, limits: WireLimits = DEFAULT_LIMITS,
               **kw: Any) -> TcpChannel:
        """Wait up to ``timeout`` seconds (``None`` = forever) for a connection that passes
        the handshake; connections that fail it are dropped (one warning each) and accepting
        goes on. ``kw`` go to :class:`TcpChannel`."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise TimeoutError(f"no authenticated connection within {timeout} s")
            self.sock.settimeout(left)
            try:
                conn, addr = self.sock.accept()
            except socket.timeout as e:
                raise TimeoutError(f"no authenticated connection within {timeout} s") from e
            try:
                agreed = listener_handshake(conn, self.secret, limits)
            except AuthError as e:
                self.dropped += 1
                log.warning("lamina: dropped a data-plane connection from %s:%s: %s",
                            addr[0], addr[1], e)
                conn.close()
                continue
            except BaseException:
                conn.close()
                raise
            try:
                return TcpChannel(conn, limits=agreed, **kw)
            except BaseException:
                conn.close()
                raise

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> "TcpListener":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
