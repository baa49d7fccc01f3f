"""The authenticated handshake every TCP data-plane connection starts with.

Whoever opens a tcp endpoint (:func:`lamina.transport.endpoint.listen`) draws a fresh 256-bit
secret; it travels with the endpoint over the control plane only (spawn or Ray actor
arguments, or an OPEN reply on a channel that is itself authenticated) and never over the
connection it guards. Before a byte of the wire protocol, the two ends run a mutual HMAC
challenge and agree on limits:

1. listener -> connector, ``HELLO`` (80 bytes): ``b"LMNH"``, version (u16), 2 pad bytes, the
   listener's nonce (32 bytes), the listener's :class:`WireLimits` (5 x u64);
2. connector -> listener, ``PROOF`` (112 bytes): ``b"LMNC"``, version, pad, the connector's
   nonce, ``HMAC-SHA256(secret, "lamina-connector" | both nonces | both limits)``, the
   connector's limits;
3. listener -> connector, ``ACCEPT`` (36 bytes): ``b"LMNK"`` and
   ``HMAC-SHA256(secret, "lamina-listener" | both nonces | both limits)``.

Every message has a fixed size, so nothing is allocated from what the peer says, and every
read has a deadline (``HANDSHAKE_TIMEOUT_S`` for a connection the listener handshakes; a
connector waits for its HELLO up to its connect timeout, since the listener handshakes one
connection at a time: a silent connector delays the real peer by at most
``HANDSHAKE_TIMEOUT_S``, never locks it out). The listener drops a connector whose PROOF is
wrong, late or malformed (one warning on the ``lamina.transport`` logger, with its address) and
keeps accepting; the connector refuses a listener whose ACCEPT is wrong (:class:`AuthError`).
Both ends then use the element-wise minimum of the two limits, so each side's decoder rejects
a header over what it declared before allocating anything.
"""
from __future__ import annotations

import hashlib
import hmac
import secrets
import socket
import struct
import time

from lamina.transport.wire import WireLimits

__all__ = ["AuthError", "HANDSHAKE_TIMEOUT_S", "new_secret", "listener_handshake",
           "connector_handshake"]

HANDSHAKE_TIMEOUT_S = 3.0
_VERSION = 1
_LIMITS = struct.Struct("<5Q")
_HELLO = struct.Struct("<4sHxx32s40s")  # 80 bytes
_PROOF = struct.Struct("<4sHxx32s32s40s")  # 112 bytes
_ACCEPT = struct.Struct("<4s32s")  # 36 bytes


class AuthError(ConnectionError):
    """A data-plane handshake failed: wrong secret, malformed or late."""


def new_secret() -> str:
    """A fresh secret for one endpoint (hex of 32 random bytes)."""
    return secrets.token_hex(32)


def _key(secret: str) -> bytes:
    try:
        key = bytes.fromhex(secret)
    except (TypeError, ValueError):
        raise ValueError("a data-plane secret is a hex string") from None
    if len(key) < 16:
        raise ValueError("a data-plane secret needs at least 16 bytes")
    return key


def _pack_limits(limits: WireLimits) -> bytes:
    return _LIMITS.pack(*limits.as_tuple())


def _unpack_limits(data: bytes) -> WireLimits:
    t, nd, tb, mb, meta = _LIMITS.unpack(data)
    try:
        return WireLimits(max_tensors=t, max_ndim=nd, max_tensor_bytes=tb, max_message_bytes=mb,
                          max_meta_bytes=meta)
    except ValueError as e:
        raise AuthError(f"bad limits in handshake: {e}") from None


def _meet(a: WireLimits, b: WireLimits) -> WireLimits:
    return WireLimits(*(min(x, y) for x, y in zip(a.as_tuple(), b.as_tuple())))


def _mac(key: bytes, role: bytes, *parts: bytes) -> bytes:
    return hmac.new(key, role + b"".join(parts), hashlib.sha256).digest()


def _read(sock: socket.socket, n: int, deadline: float) -> bytes:
    """Exactly ``n`` bytes before ``deadline`` (monotonic), else :class:`AuthError`."""
    buf = bytearray()
    while len(buf) < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise AuthError(f"handshake timed out ({len(buf)} of {n} bytes)")
        sock.settimeout(left)
        try:
            chunk = sock.recv(n - len(buf))
        except socket.timeout:
            raise AuthError(f"handshake timed out ({len(buf)} of {n} bytes)") from None
        except OSError as e:
            raise AuthError(f"handshake failed: {e}") from None
        if not chunk:
            raise AuthError(f"connection closed during the handshake ({len(buf)} of {n} bytes)")
        buf += chunk
    return bytes(buf)


def _write(sock: socket.socket, data: bytes, deadline: float) -> None:
    sock.settimeout(max(0.001, deadline - time.monotonic()))
    try:
        sock.sendall(data)
    except OSError as e:
        raise AuthError(f"handshake failed: {e}") from None


def listener_handshake(sock: socket.socket, secret: str, limits: WireLimits,
                       timeout: float = HANDSHAKE_TIMEOUT_S) -> WireLimits:
    """Run the listener's side on a freshly accepted ``sock``; returns the agreed limits.
    Raises :class:`AuthError` (the caller drops the connection and goes on accepting)."""
    key = _key(secret)
    deadline = time.monotonic() + timeout
    mine, nonce = _pack_limits(limits), secrets.token_bytes(32)
    _write(sock, _HELLO.pack(b"LMNH", _VERSION, nonce, mine), deadline)
    magic, version, peer_nonce, mac, theirs = _PROOF.unpack(_read(sock, _PROOF.size, deadline))
    if magic != b"LMNC" or version != _VERSION:
        raise AuthError("not a lamina data-plane client")
    if not hmac.compare_digest(mac, _mac(key, b"lamina-connector", nonce, peer_nonce, mine, theirs)):
        raise AuthError("wrong secret")
    agreed = _meet(limits, _unpack_limits(theirs))
    _write(sock, _ACCEPT.pack(b"LMNK", _mac(key, b"lamina-listener", peer_nonce, nonce, theirs,
                                               mine)), deadline)
    sock.settimeout(None)
    return agreed


def connector_handshake(sock: socket.socket, secret: str, limits: WireLimits,
                        timeout: float = HANDSHAKE_TIMEOUT_S) -> WireLimits:
    """Run the connector's side on a freshly connected ``sock``; returns the agreed limits.
    Raises :class:`AuthError` when the listener does not prove the same secret."""
    key = _key(secret)
    deadline = time.monotonic() + timeout
    magic, version, peer_nonce, theirs = _HELLO.unpack(_read(sock, _HELLO.size, deadline))
    if magic != b"LMNH" or version != _VERSION:
        raise AuthError("the listener is not a lamina data-plane endpoint")
    mine, nonce = _pack_limits(limits), secrets.token_bytes(32)
    _write(sock, _PROOF.pack(b"LMNC", _VERSION, nonce,
                             _mac(key, b"lamina-connector", peer_nonce, nonce, theirs, mine), mine),
           deadline)
    magic, mac = _ACCEPT.unpack(_read(sock, _ACCEPT.size, deadline))
    if magic != b"LMNK" or not hmac.compare_digest(
            mac, _mac(key, b"lamina-listener", nonce, peer_nonce, mine, theirs)):
        raise AuthError("the listener did not prove the endpoint's secret")
    sock.settimeout(None)
    return _meet(limits, _unpack_limits(theirs))
