"""Device-side polling (computenode/device_wait.py): a stream waits on a host-mapped flag
while the CPU thread that enqueued the wait goes on; without cupy or a GPU the capability
check says so and nothing is allocated."""
import threading
import time

import pytest
import torch

from lamina.computenode import device_wait


def test_capability_check_names_what_is_missing():
    why = device_wait.unavailable()
    if why is None:
        pytest.skip("cupy and a CUDA GPU are present: the gpu test below runs")
    assert "cupy" in why or "CUDA" in why
    with pytest.raises(RuntimeError, match="cupy|CUDA"):
        device_wait.DeviceFlag()


@pytest.mark.gpu
@pytest.mark.skipif(device_wait.unavailable() is not None, reason=str(device_wait.unavailable()))
def test_stream_waits_for_the_flag_and_the_cpu_does_not():
    flag = device_wait.DeviceFlag(0)
    stream = torch.cuda.Stream()
    x = torch.zeros(1 << 20, device="cuda")
    with torch.cuda.stream(stream):
        flag.wait(1, stream)  # enqueue: returns at once (we get past it with the flag unset)
        x.add_(1)  # ordered after the wait
        done = torch.cuda.Event()
        done.record(stream)
    time.sleep(0.2)
    assert not done.query()  # the stream is parked on the flag, this thread is not
    threading.Thread(target=flag.set, args=(1,)).start()
    done.synchronize()
    assert float(x.sum()) == x.numel()
    flag.wait(1, stream)  # already reached: passes straight through
    stream.synchronize()
    with pytest.raises(ValueError):
        flag.set(0)
    flag.close()


@pytest.mark.gpu
@pytest.mark.skipif(device_wait._capability(0) is not None, reason=str(device_wait._capability(0)))
def test_a_wait_that_is_never_released_gives_up_and_frees_its_stream():
    flag = device_wait.DeviceFlag(0)
    stream = torch.cuda.Stream()
    flag.wait(1, stream, timeout_s=0.05)  # nobody moves the flag
    done = torch.cuda.Event()
    done.record(stream)
    for _ in range(5000):  # bounded on the CPU too: 5 s
        if done.query():
            break
        time.sleep(0.001)
    assert done.query() and flag.timed_out
    flag.close()
