"""shm backend specifics: streaming through tiny rings, resumable partial messages, concurrent
senders, cleanup of segments and doorbell FIFOs, the plain-data spec handed to processes not
started with it. (Cross-process behaviour shared with other backends: test_conformance.py.)"""
from __future__ import annotations

import gc
import json
import os
import pickle
import stat
import subprocess
import sys
import threading

import pytest
import ray.cloudpickle as cloudpickle  # the serializer Ray hands specs to actors with
import torch

from lamina.transport import ChannelClosed, Message, MsgKind, PeerDied, ShmChannel, shm_pair
from lamina.transport.shm import ShmChannelSpec
from lamina.transport.wire import encode, encode_bytes
from wire_cases import assert_same


def files_of(spec: ShmChannelSpec) -> list[str]:
    """Paths of the segments (Linux /dev/shm) and doorbell FIFOs behind ``spec``."""
    paths = []
    for ring in (spec.a_to_b, spec.b_to_a):
        paths += [f"/dev/shm/{ring.name}", ring.data_bell, ring.space_bell]
    return paths


@pytest.mark.parametrize("capacity,spin_us", [(1, 0.0), (97, 100.0), (4096, 0.0)])
def test_tiny_rings_stream_any_message(capacity, spin_us):
    a, b = shm_pair(capacity, spin_us=spin_us)
    msgs = [Message(MsgKind.KV, step_id=i, meta={"i": i}, tensors=[torch.randn(i * 37 % 500)])
            for i in range(40)]
    t = threading.Thread(target=lambda: [a.send(m) for m in msgs])
    t.start()
    got = [b.recv(timeout=60) for _ in msgs]
    t.join()
    for m, g in zip(msgs, got):
        assert g.step_id == m.step_id and g.meta == m.meta
        assert_same(m.tensors, g.tensors)
    a.close()
    b.close()


def test_partial_message_survives_a_timeout():
    a, b = shm_pair(1 << 16)
    m = Message(MsgKind.ATTEND, step_id=4, tensors=[torch.arange(1000)])
    data = encode_bytes(m)
    for cut in (10, 48, 200):  # inside the header, after it, inside the data
        a.send_raw([data[:cut]])
        with pytest.raises(TimeoutError):
            b.recv(timeout=0.05)
        a.send_raw([data[cut:]])
        out = b.recv(timeout=10)
        assert out.step_id == 4 and torch.equal(out.tensors[0], m.tensors[0])
    a.close()
    b.close()


def test_concurrent_senders_keep_messages_whole():
    a, b = shm_pair(4096)
    n, per = 4, 50

    def sender(k):
        for i in range(per):
            a.send(Message(MsgKind.PING, step_id=k, layer=i, tensors=[torch.full((300,), k * 1000 + i)]))

    threads = [threading.Thread(target=sender, args=(k,)) for k in range(n)]
    for t in threads:
        t.start()
    got = [b.recv(timeout=60) for _ in range(n * per)]
    for t in threads:
        t.join()
    for k in range(n):
        mine = [g for g in got if g.step_id == k]
        assert [g.layer for g in mine] == list(range(per))
        assert all(torch.equal(g.tensors[0], torch.full((300,), k * 1000 + g.layer)) for g in mine)
    a.close()
    b.close()


def test_both_directions_at_once():
    """Each end sends ten times the ring size while the other receives (a send blocks while the
    ring is full, so - as with sockets - somebody must be receiving)."""
    a, b = shm_pair(1024)
    big = [torch.randn(5000) for _ in range(10)]
    got_b = []
    threads = [threading.Thread(target=lambda: [b.send(Message(MsgKind.KV, tensors=[x])) for x in big]),
               threading.Thread(target=lambda: got_b.extend(b.recv(timeout=60) for _ in big))]
    for t in threads:
        t.start()
    for x in big:
        a.send(Message(MsgKind.KV, tensors=[x]))
    got_a = [a.recv(timeout=60) for _ in big]
    for t in threads:
        t.join()
    for x, ga, gb in zip(big, got_a, got_b):
        assert torch.equal(ga.tensors[0], x) and torch.equal(gb.tensors[0], x)
    a.close()
    b.close()


def test_close_removes_segments_and_doorbells():
    a = ShmChannel.create(4096)
    paths = files_of(a.spec)
    assert all(os.path.exists(p) for p in paths)
    a.close()  # no peer ever attached: the creator removes everything
    assert [p for p in paths if os.path.exists(p)] == []


def test_names_are_removed_once_the_peer_attached():
    """Attaching removes the names (so a later kill of either process leaves nothing behind);
    both ends keep working, and the spec cannot be attached a second time."""
    a, b = shm_pair(4096)
    paths = files_of(a.spec)
    assert [p for p in paths if os.path.exists(p)] == []
    t = threading.Thread(target=lambda: a.send(Message(MsgKind.KV, tensors=[torch.randn(5000)])))
    t.start()  # 20 KB through 4 KiB rings: the doorbells still work
    assert b.recv(timeout=10).tensors[0].numel() == 5000
    t.join()
    b.send(Message(MsgKind.PING, meta={"back": 1}))
    assert a.recv(timeout=10).meta == {"back": 1}
    with pytest.raises(ChannelClosed):
        ShmChannel.attach(a.spec)
    b.close()
    a.close()
    del a, b
    gc.collect()


def test_unclosed_creator_is_cleaned_up_when_collected():
    a = ShmChannel.create(4096)
    paths = files_of(a.spec)
    del a  # never attached, never closed
    gc.collect()
    assert [p for p in paths if os.path.exists(p)] == []
    a = ShmChannel.create(4096)
    b = ShmChannel.attach(a.spec)
    del a
    gc.collect()
    b.send(Message(MsgKind.PING))  # the mapping stays valid for the survivor
    b.close()


def test_attach_checks():
    a = ShmChannel.create(4096)
    spec = a.spec
    wrong = ShmChannelSpec(spec.name, 8192, spec.bell_dir)
    with pytest.raises(ValueError):
        ShmChannel.attach(wrong)
    a.close()
    with pytest.raises(ChannelClosed):
        ShmChannel.attach(spec)  # the creator is gone
    with pytest.raises(ValueError):
        ShmChannel.create(0)


def test_closed_end_refuses_and_peer_sees_close_after_draining():
    a, b = shm_pair(4096)
    a.send(Message(MsgKind.PING, meta={"last": True}))
    a.close()
    with pytest.raises(ChannelClosed):
        a.send(Message(MsgKind.PING))
    with pytest.raises(ChannelClosed):
        a.recv(timeout=0)
    assert b.recv(timeout=5).meta == {"last": True}
    with pytest.raises(ChannelClosed):
        b.recv(timeout=5)
    with pytest.raises(ChannelClosed):
        b.send(Message(MsgKind.PING))
    b.close()


def test_a_receiver_that_never_sleeps_still_sees_timeouts_close_and_a_dead_peer():
    """spin_us=inf (a role alone on its core): recv polls without blocking, yet a deadline,
    the peer closing and the peer dying end it (checked every wake_interval)."""
    a, b = shm_pair(4096, spin_us=float("inf"), wake_interval=0.01)
    with pytest.raises(TimeoutError):
        b.recv(timeout=0.05)
    threading.Timer(0.05, a.close).start()
    with pytest.raises(ChannelClosed):
        b.recv(timeout=30)
    b.close()
    c, d = shm_pair(4096, spin_us=float("inf"), wake_interval=0.01)
    d.set_peer_alive(lambda: False)
    with pytest.raises(PeerDied):
        d.recv(timeout=30)
    c.close()
    d.close()


def test_peer_alive_hook_and_same_process_default():
    a, b = shm_pair(4096)
    assert a.peer_alive() and b.peer_alive()
    a.set_peer_alive(lambda: False)
    assert not a.peer_alive()
    a.set_peer_alive(None)
    assert a.peer_alive()
    a.close()
    b.close()


def test_send_raw_accepts_encoded_buffers():
    a, b = shm_pair(4096)  # the whole message fits: nobody receives while we send
    m = Message(MsgKind.RESULT, tensors=[torch.randn(100), torch.tensor(True)])
    a.send_raw(encode(m))
    assert_same(m.tensors, b.recv(timeout=10).tensors)
    a.close()
    b.close()


# ------------------------------------------------------------------------------ plain-data spec


def test_spec_is_plain_data():
    """The spec pickles without multiprocessing objects and round-trips through JSON."""

    a = ShmChannel.create(4096)
    spec = a.spec
    try:
        assert {type(v) for v in vars(spec).values()} <= {str, int}
        for dumps in (pickle.dumps, cloudpickle.dumps):
            data = dumps(spec)
            assert b"multiprocessing" not in data and b"Semaphore" not in data
            assert pickle.loads(data) == spec
        back = ShmChannelSpec.from_dict(json.loads(json.dumps(spec.to_dict())))
        assert back == spec
        for path in (spec.a_to_b.data_bell, spec.a_to_b.space_bell, spec.b_to_a.data_bell,
                     spec.b_to_a.space_bell):
            assert stat.S_ISFIFO(os.lstat(path).st_mode)
        b = ShmChannel.attach(json.loads(json.dumps(spec.to_dict())))  # a dict works too
        a.send(Message(MsgKind.PING, meta={"x": 1}))
        assert b.recv(timeout=10).meta == {"x": 1}
        b.close()
    finally:
        a.close()


@pytest.mark.parametrize("bad", [
    {"name": "../etc/x", "capacity": 4096, "bell_dir": "/dev/shm"},
    {"name": "a/b", "capacity": 4096, "bell_dir": "/dev/shm"},
    {"name": "", "capacity": 4096, "bell_dir": "/dev/shm"},
    {"name": "lamina_x", "capacity": "4096", "bell_dir": "/dev/shm"},
    {"name": "lamina_x", "capacity": True, "bell_dir": "/dev/shm"},
    {"name": "lamina_x", "capacity": 0, "bell_dir": "/dev/shm"},
    {"name": "lamina_x", "capacity": 4096, "bell_dir": "relative"},
    {"name": "lamina_x", "capacity": 4096},
    {"name": "lamina_x", "capacity": 4096, "bell_dir": "/dev/shm", "extra": 1},
    ["lamina_x", 4096, "/dev/shm"],
])
def test_spec_from_dict_rejects_bad_input(bad):
    with pytest.raises(ValueError):
        ShmChannelSpec.from_dict(bad)


def test_doorbells_in_a_chosen_directory(tmp_path):
    a = ShmChannel.create(4096, bell_dir=str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        f"{a.spec.name}_{d}.{k}" for d in ("ab", "ba") for k in ("data", "space"))
    b = ShmChannel.attach(a.spec)
    assert list(tmp_path.iterdir()) == []  # removed once attached
    t = threading.Thread(target=lambda: a.send(Message(MsgKind.KV, tensors=[torch.randn(5000)])))
    t.start()  # 20 KB through a 4 KiB ring: both doorbells ring many times
    assert b.recv(timeout=10).tensors[0].numel() == 5000
    t.join()
    b.close()
    a.close()
    assert list(tmp_path.iterdir()) == []


def _run_peer(arg: str) -> subprocess.Popen:
    peer = os.path.join(os.path.dirname(__file__), "shm_peers.py")
    return subprocess.Popen([sys.executable, peer, arg], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def test_spec_as_json_to_a_subprocess_not_started_with_it():
    """A child started with subprocess.Popen (not multiprocessing) gets the spec as JSON on its
    command line, attaches and echoes; neither its exit nor ours prints resource-tracker
    warnings, and nothing is left in /dev/shm."""
    a = ShmChannel.create(1 << 16)
    paths = files_of(a.spec)
    proc = _run_peer(json.dumps(a.spec.to_dict()))
    try:
        a.set_peer_alive(lambda: proc.poll() is None)
        big = torch.randn(1 << 18)  # 1 MiB through 64 KiB rings, both ways
        got = []
        t = threading.Thread(target=lambda: got.append(a.recv(timeout=120)))
        t.start()
        a.send(Message(MsgKind.KV, step_id=1, tensors=[big]))
        t.join()
        assert_same([big], got[0].tensors)
        assert [p for p in paths if os.path.exists(p)] == []  # the child attached
        for i in range(20):
            a.send(Message(MsgKind.PING, step_id=i, meta={"i": i}))
            assert a.recv(timeout=60).meta == {"i": i}
        a.send(Message(MsgKind.PING, meta={"close": True}))
        with pytest.raises(ChannelClosed):
            a.recv(timeout=60)
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
        assert out.strip() == "attached"
        assert err == ""  # e.g. no "resource_tracker: ... leaked shared_memory" warning
    finally:
        a.close()
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert [p for p in paths if os.path.exists(p)] == []


@pytest.mark.parametrize("how", ["close", "kill"])
def test_subprocess_creator_closed_or_killed_after_attach_leaves_nothing(how):
    """The creator is a subprocess that prints its spec; we attach from here. Whether it closes
    normally (its stderr, which its resource tracker shares, stays empty) or is SIGKILLed
    (we see PeerDied), nothing of the channel is left in /dev/shm."""
    proc = _run_peer("create")
    try:
        spec = ShmChannelSpec.from_dict(json.loads(proc.stdout.readline()))
        b = ShmChannel.attach(spec, wake_interval=0.02)
        paths = files_of(spec)
        assert [p for p in paths if os.path.exists(p)] == []
        b.send(Message(MsgKind.PING, meta={"hi": 1}))
        assert b.recv(timeout=60).meta == {"hi": 1}
        if how == "close":
            b.send(Message(MsgKind.PING, meta={"close": True}))
            with pytest.raises(ChannelClosed):
                b.recv(timeout=60)
            _, err = proc.communicate(timeout=60)
            assert proc.returncode == 0 and err == "", err
        else:
            proc.kill()
            with pytest.raises(PeerDied):
                b.recv(timeout=60)  # the pid-based default check
            proc.communicate(timeout=60)
        b.close()
        assert [p for p in paths if os.path.exists(p)] == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def test_two_ends_writing_past_full_rings_at_once_finish_when_one_drains():
    """A replica streams an ATTEND bigger than the ring while its node streams a RESULT back:
    each writer waits for the other to read. ``send(while_full=...)`` keeps one side taking
    its messages in meanwhile, so both finish (without it, both would wait forever)."""
    import threading

    import torch

    from lamina.transport.shm import shm_pair
    from lamina.transport.wire import Message, MsgKind
    a, b = shm_pair(capacity=1 << 16, spin_us=0.0, wake_interval=0.002)
    big = [torch.arange(200_000, dtype=torch.float32)]  # 800 KB: 12 rings' worth
    got_a: list = []
    got_b: list = []

    def node():  # writes its RESULT first, then reads what was sent to it
        b.send(Message(MsgKind.RESULT, 1, 0, tensors=big))
        got_b.append(b.recv(10))

    def drain():  # what the replica's inbox does: take in the whole messages waiting
        if not got_a:
            got_a.append(a.recv(10))
    try:
        other = threading.Thread(target=node)
        other.start()
        a.send(Message(MsgKind.ATTEND, 1, 0, tensors=big), while_full=drain)
        other.join(10)
        assert not other.is_alive()
        assert got_a and torch.equal(got_a[0].tensors[0], big[0])
        assert got_b and torch.equal(got_b[0].tensors[0], big[0])
    finally:
        a.close()
        b.close()
