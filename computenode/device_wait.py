"""Device-side polling: a CUDA stream waits for a flag in host-mapped memory, so the CPU never
blocks the stream (Lamina §5.3; StepMesh's wait kernel does the same over RDMA).

With compute on a GPU and memory nodes elsewhere, the replica enqueues a layer's work after
an attention result it does not have yet. :class:`DeviceFlag` is one u64 counter in pinned,
device-mapped host memory (``cudaHostAlloc(..., cudaHostAllocMapped)``):

* :meth:`DeviceFlag.wait` enqueues, on a stream, a one-thread kernel that spins (with
  ``__nanosleep``) until the counter reaches a target, then returns: work enqueued after it on
  that stream starts only then, while the calling CPU thread returns at once;
* :meth:`DeviceFlag.set` (any CPU thread, e.g. the receiver that copied the attention result
  into device memory with a stream-ordered copy *before* the wait) publishes a new value with
  a release store.

Contract: values only grow (one per step or layer); ``set`` must follow the writes the waiting
work depends on (the flag is a release, the kernel's volatile load the acquire); the counter
lives as long as the object. Capability: cupy, a CUDA device that can map host memory
(:func:`unavailable` says what is missing; :class:`DeviceFlag` raises with that text; nothing
falls back silently). Tested under ``pytest -m gpu`` only (tests/computenode/test_device_wait.py);
used by :mod:`lamina.computenode.polling` (replicas pre-launching their next slice).
"""
from __future__ import annotations

import ctypes
import threading

from lamina.transport.ring_memory import fence

_SOURCE = r"""
extern "C" __global__ void lamina_wait_flag(const volatile unsigned long long* flag,
                                            unsigned long long target) {
    unsigned int backoff = 32;
    while (*flag < target) {
#if __CUDA_ARCH__ >= 700
        __nanosleep(backoff);
        if (backoff < 1024) backoff <<= 1;
#endif
    }
    __threadfence_system();
}
"""
_KERNEL = None
_LOCK = threading.Lock()


def unavailable(device: int = 0) -> str | None:
    """Why device-side polling cannot run here (``None``: it can)."""
    try:
        import cupy
    except ImportError as e:
        return f"device-side polling needs cupy and a CUDA GPU; cupy: {e}"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
        if count <= device:
            return f"device-side polling needs CUDA device {device}; found {count}"
        attr = cupy.cuda.runtime.deviceGetAttribute(cupy.cuda.runtime.cudaDevAttrCanMapHostMemory, device)
    except Exception as e:  # noqa: BLE001 - no driver, no device: the same verdict
        return f"device-side polling needs a CUDA GPU: {e}"
    if not attr:
        return f"CUDA device {device} cannot map host memory (cudaDevAttrCanMapHostMemory = 0)"
    return None


def _kernel():
    global _KERNEL
    with _LOCK:
        if _KERNEL is None:
            import cupy
            _KERNEL = cupy.RawKernel(_SOURCE, "lamina_wait_flag")
        return _KERNEL


class DeviceFlag:
    """One u64 counter in host-mapped memory that CUDA streams can wait on (module docstring)."""

    def __init__(self, device: int = 0) -> None:
        why = unavailable(device)
        if why is not None:
            raise RuntimeError(why)
        import cupy

        rt = cupy.cuda.runtime
        self.device = device
        with cupy.cuda.Device(device):
            self._host = rt.hostAlloc(8, rt.hostAllocMapped)
            self._dev = rt.hostGetDevicePointer(self._host, 0)
        self._word = ctypes.c_uint64.from_address(self._host)
        self._word.value = 0
        self._closed = False

    @property
    def value(self) -> int:
        return int(self._word.value)

    def set(self, value: int) -> None:
        """Publish ``value`` (>= the current one) to every stream waiting for it."""
        if value < self._word.value:
            raise ValueError(f"flag values only grow: {value} < {self._word.value}")
        fence()  # what the waiting work reads is written before the flag moves
        self._word.value = value

    def wait(self, target: int, stream=None) -> None:
        """Enqueue on ``stream`` (a ``torch.cuda.Stream``; default torch's current one) a wait
        until the counter is ``>= target``. Returns at once."""
        import cupy
        import torch

        s = stream if stream is not None else torch.cuda.current_stream(self.device)
        with cupy.cuda.Device(self.device), cupy.cuda.ExternalStream(s.cuda_stream):
            _kernel()((1,), (1,), (cupy.uint64(self._dev), cupy.uint64(target)))

    def close(self) -> None:
        if not self._closed:
            import cupy

            self._closed = True
            cupy.cuda.runtime.freeHost(self._host)

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass
