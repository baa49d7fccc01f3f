"""Hostile connectors against data-plane ports (issue 20, part 4): the authenticated handshake
of lamina/transport/auth.py in front of every tcp listener. Garbage, truncated, oversized and
wrong-secret connections are dropped, the listener keeps accepting, memory stays bounded, an
unauthenticated connector gets nothing but the fixed-size HELLO, and the real peer is served.
The target is a real memory-node server (memnode/server.py) opening a tcp peer link, as under
``transport="tcp"``."""
from __future__ import annotations

import logging
import socket
import struct
import threading

import psutil
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lamina.memnode import MemoryNode
from lamina.memnode.server import NodeServer
from lamina.transport import codec
from lamina.transport.auth import AuthError, new_secret
from lamina.transport.endpoint import connect, listen
from lamina.transport.node_client import RemoteNode
from lamina.transport.shm import shm_pair
from lamina.transport.tcp import TcpChannel, TcpListener
from lamina.transport.wire import (Message, MsgKind, WireError, WireLimits, encode_bytes)
from lamina.types import AttendMsg, AttentionSpec, PrepareMsg, ShardWork

SPEC = AttentionSpec(layer=0, num_heads=2, num_kv_heads=1, head_dim=4, scale=0.5)
HELLO_BYTES = 80


@pytest.fixture
def node():
    """A memory-node server in a thread, driven by the engine's RemoteNode over shm."""
    engine_end, node_end = shm_pair(capacity=1 << 16)
    server = NodeServer(MemoryNode([SPEC], 64, slab_size=4))
    thread = threading.Thread(target=server.serve, args=(node_end,), daemon=True)
    thread.start()
    client = RemoteNode(engine_end, None, "memory node 0")
    yield client
    client.close()
    thread.join(10)


def _attack(host: str, port: int, payload: bytes, read: bool = True) -> bytes:
    """Connect, send ``payload``, half-close, and return everything the listener sent."""
    s = socket.create_connection((host, port), timeout=10)
    try:
        if payload:
            try:
                s.sendall(payload)
            except OSError:  # the listener may close first (it reads at most one PROOF)
                pass
        try:
            s.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        got = b""
        while read:
            try:
                chunk = s.recv(65536)
            except OSError:
                break
            if not chunk:
                break
            got += chunk
        return got
    finally:
        s.close()


def _serve_real_peer(client: RemoteNode, endpoint: dict) -> None:
    """The real replica joins after the attacks and gets an exact ATTEND reply."""
    peer = connect(endpoint)
    try:
        works = [ShardWork(7, 0, 3, 0, 3)]
        peer.send(codec.to_message(PrepareMsg(1, works)))
        assert peer.recv(10).kind == MsgKind.OK
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(3, 2, 4, generator=g), torch.randn(3, 1, 4, generator=g),
                   torch.randn(3, 1, 4, generator=g))
        peer.send(codec.to_message(AttendMsg(1, 0, q, k, v, reply_to=0)))
        res = codec.from_message(peer.recv(10))
        ref = MemoryNode([SPEC], 64, slab_size=4)
        ref.prepare(PrepareMsg(1, works))
        want = ref.attend(AttendMsg(1, 0, q, k, v))
        assert torch.equal(res.o, want.o) and torch.equal(res.lse, want.lse)
    finally:
        peer.close()


def _proof(nonce: bytes = b"\0" * 32, mac: bytes = b"\0" * 32, limits=(64, 8, 1 << 30, 1 << 31, 1 << 20),
           magic: bytes = b"LMNC", version: int = 1) -> bytes:
    return struct.pack("<4sHxx32s32s40s", magic, version, nonce, mac, struct.pack("<5Q", *limits))


ATTACKS = {
    "connect_and_close": b"",
    "http": b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
    "wire_message_without_handshake": encode_bytes(Message(MsgKind.SHUTDOWN)),
    "truncated_proof": _proof()[:50],
    "wrong_mac": _proof(),
    "bad_magic": _proof(magic=b"XXXX"),
    "bad_version": _proof(version=9),
    "bad_limits": _proof(limits=(1, 99, 1, 1, 1)),
    "oversized_garbage": b"\xff" * (8 << 20),
}


def test_every_hostile_connector_is_dropped_and_the_real_peer_is_served(node, caplog):
    endpoint = node.open_peer(0, "tcp")
    host, port = endpoint["host"], int(endpoint["port"])
    rss0 = psutil.Process().memory_info().rss
    with caplog.at_level(logging.WARNING, logger="lamina.transport"):
        for name, payload in ATTACKS.items():
            got = _attack(host, port, payload)
            # an unauthenticated connector gets the fixed-size HELLO and nothing else
            assert len(got) == HELLO_BYTES and got[:4] == b"LMNH", name
        _serve_real_peer(node, endpoint)
    dropped = [r for r in caplog.records if "dropped a data-plane connection" in r.getMessage()]
    assert len(dropped) == len(ATTACKS)
    assert psutil.Process().memory_info().rss - rss0 < 64 << 20  # nothing sized by the attacker
    with pytest.raises(OSError):  # once the peer joined, the port is closed
        socket.create_connection((host, port), timeout=2).close()


def test_a_silent_connector_only_delays_the_real_peer(node):
    endpoint = node.open_peer(0, "tcp")
    stalled = socket.create_connection((endpoint["host"], int(endpoint["port"])), timeout=10)
    try:  # holds the handshake until its deadline (3 s), then is dropped
        _serve_real_peer(node, endpoint)
    finally:
        stalled.close()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(st.binary(max_size=400))
def test_random_bytes_never_get_past_the_handshake(payload):
    with TcpListener("127.0.0.1", 0) as lis:
        got: list = []
        t = threading.Thread(target=lambda: got.append(lis.accept(timeout=20)), daemon=True)
        t.start()
        seen = _attack(*lis.address, payload)
        assert len(seen) == HELLO_BYTES
        real = TcpChannel.connect(*lis.address, secret=lis.secret)
        t.join(20)
        try:
            assert lis.dropped == 1 and len(got) == 1
            real.send(Message(MsgKind.PING, meta={"n": 1}))
            assert got[0].recv(10).meta == {"n": 1}
        finally:
            real.close()
            got[0].close()


def test_a_wrong_secret_is_refused_at_both_ends():
    with TcpListener("127.0.0.1", 0) as lis:
        t = threading.Thread(target=lambda: pytest.raises(TimeoutError, lis.accept, timeout=3),
                             daemon=True)
        t.start()
        with pytest.raises(AuthError):
            TcpChannel.connect(*lis.address, secret=new_secret())
        t.join(10)
        assert lis.dropped == 1


def test_a_fake_listener_cannot_impersonate_the_endpoint():
    """The connector checks the listener's proof too: a server that does not hold the secret
    (it just echoes a plausible HELLO and ACCEPT) is refused before any message is sent."""
    srv = socket.create_server(("127.0.0.1", 0))
    host, port = srv.getsockname()[:2]

    def fake():
        conn, _ = srv.accept()
        conn.sendall(struct.pack("<4sHxx32s40s", b"LMNH", 1, b"\1" * 32,
                                 struct.pack("<5Q", 64, 8, 1 << 30, 1 << 31, 1 << 20)))
        conn.recv(112)
        conn.sendall(b"LMNK" + b"\0" * 32)
        conn.close()

    t = threading.Thread(target=fake, daemon=True)
    t.start()
    try:
        with pytest.raises(AuthError, match="did not prove"):
            TcpChannel.connect(host, port, secret=new_secret())
    finally:
        t.join(10)
        srv.close()


def test_limits_are_agreed_at_the_handshake():
    """Each end declares what it accepts; both use the element-wise minimum, so a header over
    the receiver's declared limits is refused before anything is allocated or sent."""
    small = WireLimits(max_tensor_bytes=1024)
    with TcpListener("127.0.0.1", 0) as lis:
        got: list = []
        t = threading.Thread(target=lambda: got.append(lis.accept(timeout=10)), daemon=True)
        t.start()
        conn = TcpChannel.connect(*lis.address, secret=lis.secret, limits=small)
        t.join(10)
        server = got[0]
        try:
            assert server.limits.max_tensor_bytes == 1024 == conn.limits.max_tensor_bytes
            with pytest.raises(WireError, match="limit 1024"):
                server.send(Message(MsgKind.KV, tensors=[torch.zeros(1024)]))  # 4 KiB
            server.send(Message(MsgKind.KV, tensors=[torch.zeros(256)]))
            assert conn.recv(10).tensors[0].numel() == 256
        finally:
            conn.close()
            server.close()


def test_a_stalled_frame_fails_instead_of_blocking_for_good():
    with TcpListener("127.0.0.1", 0) as lis:
        got: list = []
        t = threading.Thread(target=lambda: got.append(lis.accept(timeout=10, frame_timeout=0.5)),
                             daemon=True)
        t.start()
        conn = TcpChannel.connect(*lis.address, secret=lis.secret)
        t.join(10)
        server = got[0]
        try:
            whole = encode_bytes(Message(MsgKind.KV, tensors=[torch.ones(100)]))
            conn.send_raw([whole[:60]])  # a header and part of a descriptor, then nothing
            with pytest.raises(WireError, match="truncated message"):
                server.recv(timeout=30)
        finally:
            conn.close()
            server.close()


def test_endpoints_carry_a_fresh_secret_each():
    a, b = listen("tcp"), listen("tcp")
    try:
        assert a.endpoint["secret"] != b.endpoint["secret"] and len(a.endpoint["secret"]) == 64
        assert a.endpoint["host"] == "127.0.0.1"
    finally:
        a.close()
        b.close()
