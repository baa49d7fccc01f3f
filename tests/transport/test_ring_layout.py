"""One source for the ring's wire layout: the C++ fast path exports what it assumes (``layout()``
and its status codes), shm_fast.load() checks that against the Python definitions and refuses a
module that differs, naming the field; and the fast path's calls answer with those statuses."""
from __future__ import annotations

import gc
import glob
import os
import types

import pytest
import torch

from lamina.transport import ring_memory, shm_fast, wire
from lamina.transport.ring_memory import R_CLOSED
from lamina.transport.shm import ShmChannel
from lamina.transport.wire import Message, MsgKind, WireError

FAST = shm_fast.load()
needs_fast = pytest.mark.skipif(
    FAST is None, reason=f"shm fast path not built: {shm_fast.EXTENSION.build_error()}")

HEADER_NAMES = ("magic", "version", "kind", "step_id", "layer", "reply_to", "num_tensors",
                "meta_len", "total")
DESC_NAMES = ("code", "ndim", "nbytes", "shape")


def fake_module(**changes) -> types.ModuleType:
    """A stand-in for the extension exporting Python's layout (C++'s shape: rows named) and
    statuses, with ``changes`` applied (a layout key, or a status name)."""
    lay = shm_fast.expected_layout()
    for key, names in (("header", HEADER_NAMES), ("descriptor", DESC_NAMES)):
        size, rows = lay[key]
        lay[key] = (size, [(n, *r) for n, r in zip(names, rows)])
    mod = types.ModuleType("fake_lamina_shm_ring")
    for name, value in shm_fast.STATUSES.items():
        setattr(mod, name, value)
    for key, value in changes.items():
        if key in shm_fast.STATUSES:
            setattr(mod, key, value)
        elif value is None:
            del lay[key]
        else:
            lay[key] = value
    mod.layout = lambda: lay
    return mod


def test_python_rows_of_the_wire_structs():
    assert shm_fast._rows(wire.HEADER_FORMAT) == [
        (0, 4, "s"), (4, 2, "u"), (6, 2, "u"), (8, 8, "i"), (16, 8, "i"), (24, 8, "i"),
        (32, 4, "u"), (36, 4, "u"), (40, 8, "u")]
    assert shm_fast._rows(wire.DESC_FORMAT) == [(0, 1, "u"), (1, 1, "u"), (8, 8, "u"),
                                                (16, 64, "i")]
    assert wire.LIMIT_FIELDS == tuple(wire.WireLimits.__dataclass_fields__)
    assert wire.DEFAULT_LIMITS.as_tuple() == tuple(getattr(wire.DEFAULT_LIMITS, f)
                                                   for f in wire.LIMIT_FIELDS)


@needs_fast
def test_the_extension_exports_python_s_layout_and_statuses():
    shm_fast.check_layout(FAST)  # raises on any difference
    got = FAST.layout()
    assert got["dtypes"] == {code: (dt, torch.empty((), dtype=dt).element_size())
                             for dt, code in wire.DTYPE_CODES.items()}
    assert got["ctl_words"] == {n: getattr(ring_memory, n) for n in shm_fast.CTL_WORDS}
    assert (got["magic"], got["version"], got["align"], got["max_ndim"]) == \
        (wire.MAGIC, wire.VERSION, wire.ALIGN, wire.MAX_NDIM)
    assert got["limits"] == wire.LIMIT_FIELDS
    assert got["header"][0] == wire.HEADER_SIZE and got["descriptor"][0] == wire.DESC_SIZE
    assert tuple(r[0] for r in got["header"][1]) == HEADER_NAMES
    assert tuple(r[0] for r in got["descriptor"][1]) == DESC_NAMES
    assert {n: getattr(FAST, n) for n in shm_fast.STATUSES} == shm_fast.STATUSES
    assert len(set(shm_fast.STATUSES.values())) == len(shm_fast.STATUSES)


def test_a_faithful_stand_in_passes():
    shm_fast.check_layout(fake_module())


def _swap(d: dict, a, b) -> dict:
    d = dict(d)
    d[a], d[b] = d[b], d[a]
    return d


_LAY = shm_fast.expected_layout()
_HEADER = fake_module().layout()["header"]
_DESC = fake_module().layout()["descriptor"]


@pytest.mark.parametrize("changes, names", [
    ({"dtypes": _swap(_LAY["dtypes"], 9, 10)}, ["dtype code 9", "dtype code 10"]),
    ({"dtypes": {c: v for c, v in _LAY["dtypes"].items() if c != 3}},
     ["dtype code 3: C++ missing"]),
    ({"ctl_words": {**_LAY["ctl_words"], "TAIL": 9}}, ["control word TAIL: C++ 9"]),
    ({"ctl_words": {**_LAY["ctl_words"], "W_CLOSED": 33}}, ["control word W_CLOSED"]),
    ({"header": (48, [*_HEADER[1][:3], ("step_id", 8, 8, "u"), *_HEADER[1][4:]])},
     ["header field 3 (step_id)"]),
    ({"header": (48, _HEADER[1][:-1])}, ["header: C++ has 8 fields"]),
    ({"descriptor": (88, _DESC[1])}, ["descriptor size: C++ 88"]),
    ({"magic": b"LMNB"}, ["magic"]),
    ({"version": 2}, ["version"]),
    ({"align": 32}, ["align"]),
    ({"limits": _LAY["limits"][::-1]}, ["limits"]),
    ({"dtypes": None}, ["dtypes: missing"]),
    ({"header": 48}, ["header: C++ exports 48"]),
    ({"HELD": 4}, ["status HELD: C++ 4"]),
    ({"SENT": None}, ["status SENT"]),
    ({"dtypes": _swap(_LAY["dtypes"], 1, 2), "TAKEN": 70}, ["dtype code 1", "status TAKEN"]),
])
def test_a_mismatched_layout_is_refused_naming_the_field(changes, names):
    with pytest.raises(shm_fast.LayoutMismatch) as err:
        shm_fast.check_layout(fake_module(**changes))
    for name in names:
        assert name in str(err.value)


def test_a_module_without_layout_is_refused():
    mod = fake_module()
    del mod.layout
    with pytest.raises(shm_fast.LayoutMismatch, match="dtypes: missing"):
        shm_fast.check_layout(mod)


def test_load_refuses_a_mismatched_extension_every_time(monkeypatch, kernels):
    """A mismatch raises from load() (so from every channel that would use the fast path); it
    never quietly falls back to the Python path."""
    kernels("auto")
    monkeypatch.setattr(shm_fast, "_checked", type(shm_fast._checked)())
    bad = fake_module(dtypes=_swap(_LAY["dtypes"], 4, 5))
    monkeypatch.setattr(shm_fast.EXTENSION, "load", lambda: bad)
    for _ in range(2):  # not cached as checked
        with pytest.raises(shm_fast.LayoutMismatch, match="dtype code 4"):
            shm_fast.load()
    before = set(glob.glob(f"/dev/shm/lamina_{os.getpid()}_*"))
    with pytest.raises(shm_fast.LayoutMismatch):
        ShmChannel.create(1 << 12)
    gc.collect()  # the half-built channel's segments go with it
    assert set(glob.glob(f"/dev/shm/lamina_{os.getpid()}_*")) <= before
    kernels("torch")  # no C++ at all: nothing to check
    assert shm_fast.load() is None
    good = fake_module()
    monkeypatch.setattr(shm_fast.EXTENSION, "load", lambda: good)
    kernels("auto")
    assert shm_fast.load() is good


@needs_fast
def test_the_fast_calls_answer_with_named_statuses():
    a = ShmChannel.create(1 << 12, fast=True)
    b = ShmChannel.attach(a.spec, fast=True)
    w, r = a._writer, b._reader
    try:
        x = torch.arange(6, dtype=torch.int32)
        assert r.recv(0, 0) == (shm_fast.EMPTY, None)
        assert w.send(int(MsgKind.PING), 1, 2, 3, b"", [x]) == shm_fast.SENT
        status, msg = r.recv(0, 0)
        assert status == shm_fast.TAKEN and isinstance(msg, Message)
        assert (msg.kind, msg.step_id, msg.layer, msg.reply_to, msg.meta) == \
            (MsgKind.PING, 1, 2, 3, {})
        assert torch.equal(msg.tensors[0], x)
        assert w.send(int(MsgKind.KV), 4, 5, 6, b'{"a":1}', []) == shm_fast.SENT
        status, fields = r.recv(0, 0)
        assert status == shm_fast.HELD and fields == (int(MsgKind.KV), 4, 5, 6, b'{"a":1}', [])
        assert r.recv(0, 0)[0] == shm_fast.HELD  # not committed: still there
        assert r.commit() == shm_fast.TAKEN
        assert r.recv(0, 0) == (shm_fast.EMPTY, None)
        for args in [(int(MsgKind.PING), 1 << 63, 0, 0, b"", []),  # out of int64
                     (int(MsgKind.PING), 0, 0, 0, b"", [x.numpy()]),  # not a tensor
                     (int(MsgKind.PING), 0, 0, 0, b"", [x[::2]]),  # not contiguous
                     (int(MsgKind.PING), 0, 0, 0, b"", [x.to_sparse()]),  # not strided
                     (999, 0, 0, 0, b"", [])]:  # not a kind
            assert w.send(*args) == shm_fast.INELIGIBLE, args
        assert w.send(int(MsgKind.KV), 0, 0, 0, b"", [torch.zeros(2048)]) == shm_fast.NO_ROOM
        with pytest.raises(WireError, match="out of range"):  # the Python encoder's verdict
            a.send(Message(MsgKind.PING, step_id=1 << 63))
        b._rx.ctl[R_CLOSED] = 1  # b's rx is a's tx: its reader closed
        assert w.send(int(MsgKind.PING), 0, 0, 0, b"", []) == shm_fast.PEER_CLOSED
    finally:
        a.close()
        b.close()
