"""Devices a role owns (lamina/device.py): parsing, splitting cores among roles, the default
split between compute and memory roles, and pinning (in a subprocess, so this one stays free)."""
import os
import subprocess
import sys

import pytest

from lamina.device import Device, available_cores, default_cores, parse, split


def test_parse_forms_and_their_strings():
    assert parse("cpu") == Device("cpu")
    assert parse("CPU:0").cores == (0,)
    many = os.cpu_count() >= 2 and len(available_cores()) >= 2
    if many:
        assert parse("cpu:0-1").cores == (0, 1)
        assert parse("cpu:1,0").cores == (0, 1)
        assert str(parse("cpu:0-1")) == "cpu:0-1"
    assert parse("cpu").torch == "cpu" and parse("cpu:0").torch == "cpu"


@pytest.mark.parametrize("spec,match", [
    ("tpu:0", "expected cpu"), ("cpu:x", "cores must look like"), ("cpu:3-1", "cores must look like"),
    ("cpu:4096", "not available to this process"), ("cuda:x", "expected cuda or cuda:N")])
def test_bad_devices_are_clear_errors(spec, match):
    with pytest.raises(ValueError, match=match):
        parse(spec)


def test_cuda_without_a_gpu_is_refused_clearly():
    import torch
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: cuda:0 is valid here")
    from lamina.config import deployment_config
    with pytest.raises(ValueError, match="needs a CUDA GPU"):
        deployment_config("x", device="cuda:0", memory_device="cpu:0")


def test_cuda_graphs_need_a_cuda_compute_device():
    from lamina.config import deployment_config
    with pytest.raises(ValueError, match="cuda_graphs needs a CUDA compute device"):
        deployment_config("x", device="cpu", cuda_graphs=True)
    assert deployment_config("x").instance.cuda_graphs is False


def test_split_gives_disjoint_shares_and_shares_only_when_short():
    d = Device("cpu", cores=tuple(range(7)))
    parts = split(d, 3)
    assert [p.cores for p in parts] == [(0, 1, 2), (3, 4), (5, 6)]
    assert [p.cores for p in split(Device("cpu", cores=(4, 5)), 3)] == [(4,), (5,), (4,)]
    assert split(Device("cpu"), 2) == [Device("cpu")] * 2


def test_default_cores_are_disjoint_when_there_are_two():
    cd, md = default_cores(1, 1)
    cores = available_cores()
    if len(cores) >= 2:
        assert set(cd.cores).isdisjoint(md.cores)
        assert set(cd.cores) | set(md.cores) == set(cores)
    else:
        assert cd.cores == md.cores == cores


def test_procs_role_devices_follow_the_named_cores():
    from lamina.config import deployment_config
    cfg = deployment_config("x", compute=2, memory=2, placement="procs", device="cpu:0",
                            memory_device="cpu:0")
    replicas, nodes = cfg.instance.role_devices()
    assert [d.cores for d in replicas + nodes] == [(0,)] * 4  # told to share one core


def test_own_cores_pins_and_sizes_the_thread_pool():
    code = ("import os, torch; from lamina.device import own_cores; n = own_cores([0]); "
            "print(sorted(os.sched_getaffinity(0)), torch.get_num_threads(), n)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split("\n")[0] == "[0] 1 1"


def test_receiver_spin_follows_core_ownership():
    """Links: a node alone on its cores polls for good, roles on shared cores never poll, the
    rest briefly; a replica's main thread polls its node rings for good when it is alone."""
    from lamina.instance import receiver_spin
    from lamina.transport.endpoint import SPIN_US
    inf = float("inf")
    own = [parse("cpu:0")], [parse("cpu:1")]
    assert receiver_spin(*own, True) == ([SPIN_US, inf], [inf])
    assert receiver_spin(*own, False) == ([SPIN_US, SPIN_US], [SPIN_US])  # several instances
    shared = [parse("cpu:0")], [parse("cpu:0")]
    assert receiver_spin(*shared, True) == ([0.0, 0.0], [0.0])
    unpinned = [parse("cpu")], [parse("cpu")]
    assert receiver_spin(*unpinned, True) == ([SPIN_US, SPIN_US], [SPIN_US])
