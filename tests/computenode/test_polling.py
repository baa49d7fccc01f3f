"""Pre-launched slices (computenode/polling.py): the CPU stand-in's contract, and the config's
refusals. The CUDA implementation is tested under ``gpu``; the replica server's use of it (in
processes, greedy output equal to HF) in tests/e2e/test_pipeline_processes.py."""
import os

import pytest
import torch

from lamina.computenode.polling import EmulatedPolling, make_polling
from lamina.config import deployment_config


def test_emulated_prelaunch_runs_at_land_on_the_landed_output():
    p = EmulatedPolling("cpu")
    seen = []
    ahead = p.prelaunch(0, torch.zeros(3, 2, 4), lambda o: seen.append(o.clone()) or o.sum())
    assert seen == [] and ahead.target == 1 and ahead.buffer.shape == (3, 2, 4)
    o = torch.randn(3, 2, 4)
    assert torch.equal(p.land(ahead, o), o.sum())
    assert torch.equal(seen[0], o) and p.landed == 1
    assert p.prelaunch(0, o, lambda o: None).target == 2 and p.prelaunch(1, o, lambda o: None).target == 1
    with pytest.raises(ValueError, match="does not fit the pre-launched slice's buffer"):
        p.land(p.prelaunch(0, o, lambda o: None), torch.zeros(3, 2, 5))


def test_modes():
    assert make_polling("off", "cpu") is None
    with pytest.raises(ValueError, match="off, cuda or emulated"):
        make_polling("maybe", "cpu")
    with pytest.raises(RuntimeError, match="CUDA compute device"):
        make_polling("cuda", "cpu")


@pytest.mark.parametrize("kw,match", [
    (dict(device_polling="cuda", placement="procs"), "CUDA compute device|cupy|CUDA"),
    (dict(device_polling="sometimes", placement="procs"), "device_polling must be one of")])
def test_config_refuses_what_cannot_run(kw, match):
    if kw["device_polling"] == "cuda" and torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(ValueError, match=match):
        deployment_config("x", **kw)


def test_eager_module_loading_is_set_before_cuda_starts_and_refused_after(monkeypatch):
    from lamina.computenode.polling import eager_module_loading
    monkeypatch.delenv("CUDA_MODULE_LOADING", raising=False)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    eager_module_loading()
    assert os.environ["CUDA_MODULE_LOADING"] == "EAGER"
    eager_module_loading()  # already eager: nothing to do, even once CUDA runs
    monkeypatch.setenv("CUDA_MODULE_LOADING", "LAZY")
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with pytest.raises(RuntimeError, match="CUDA_MODULE_LOADING=EAGER before CUDA starts"):
        eager_module_loading()


def _cuda_polling(**kw):
    from lamina.computenode.device_wait import unavailable
    if unavailable() is not None:
        pytest.skip(unavailable())
    return make_polling("cuda", "cuda:0", **kw)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_prelaunched_work_waits_for_its_landing():
    p = _cuda_polling()
    x = torch.zeros(1, device="cuda")
    ahead = p.prelaunch(0, torch.zeros(4, device="cuda"), lambda o: (x.add_(o.sum()), o * 2)[1])
    done = torch.cuda.Event()
    with p.stream(0):
        done.record()
    assert not done.query()  # parked on the flag
    out = p.land(ahead, torch.ones(4))
    p.streams[0].synchronize()
    assert float(x) == 4 and torch.equal(out, torch.full((4,), 2.0, device="cuda"))
    with pytest.raises(ValueError, match="from host memory"):
        p.land(p.prelaunch(0, torch.zeros(4, device="cuda"), lambda o: o), torch.ones(4, device="cuda"))
    p.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_other_slots_work_while_one_waits():
    """What a replica does between a slot's prelaunch and its landing (the other slot's slice:
    fresh device allocations, a read-back to the host) must not wait behind the parked slot."""
    from lamina.computenode import device_wait

    p = _cuda_polling(slots=2, max_tokens=64)
    timeout, device_wait.WAIT_TIMEOUT_S = device_wait.WAIT_TIMEOUT_S, 5.0
    try:
        q = torch.randn(16, 3, 8, device="cuda")
        ahead = p.prelaunch(0, q, lambda o: o * 3)
        assert p.staging[1].numel() == 64 * 3 * 8 * 4
        with p.stream(1):
            for n in (1 << 20, 3 << 20, 7 << 20):
                y = torch.randn(n, device="cuda")
                assert y.cpu().shape == (n,)
        o = torch.randn(16, 3, 8)
        out = p.land(ahead, o)
        assert torch.equal(out.cpu(), o * 3) and not p.flags[0].timed_out
        with pytest.raises(ValueError, match="does not fit the staging buffer"):
            p.prelaunch(1, torch.zeros(65, 3, 8, device="cuda"), lambda o: o)
    finally:
        device_wait.WAIT_TIMEOUT_S = timeout
        p.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_a_timed_out_wait_fails_its_landing_only():
    from lamina.computenode import device_wait

    p = _cuda_polling()
    timeout, device_wait.WAIT_TIMEOUT_S = device_wait.WAIT_TIMEOUT_S, 0.2
    try:
        ahead = p.prelaunch(0, torch.zeros(4, device="cuda"), lambda o: o + 1)
        p.streams[0].synchronize()  # the wait gives up after 0.2 s
        with pytest.raises(RuntimeError, match="gave up"):
            p.land(ahead, torch.ones(4))
        device_wait.WAIT_TIMEOUT_S = timeout
        ahead = p.prelaunch(0, torch.zeros(4, device="cuda"), lambda o: o + 1)
        assert torch.equal(p.land(ahead, torch.ones(4)).cpu(), torch.full((4,), 2.0))
    finally:
        device_wait.WAIT_TIMEOUT_S = timeout
        p.close()
