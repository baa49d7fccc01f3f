"""Device-side polling: a CUDA stream waits for a flag in host-mapped memory, so the CPU never
blocks the stream (Lamina §5.3; StepMesh's wait kernel does the same over RDMA).

With compute on a GPU and memory nodes elsewhere, the replica enqueues a layer's work after
an attention result it does not have yet. :class:`DeviceFlag` is one u64 counter in pinned,
device-mapped host memory (``cudaHostAlloc(..., cudaHostAllocMapped)``):

* :meth:`DeviceFlag.wait` enqueues, on a stream, a one-thread kernel that spins (with
  ``__nanosleep``) until the counter reaches a target, then returns: work enqueued after it on
  that stream starts only then, while the calling CPU thread returns at once. The wait is
  bounded (``timeout_s``, read from the GPU's ``%globaltimer``): past it the kernel gives up,
  marks :attr:`DeviceFlag.timed_out` and lets the stream go on, so a flag that never moves
  cannot hang a GPU;
* :meth:`DeviceFlag.set` (any CPU thread, e.g. the receiver that copied the attention result
  into device memory with a stream-ordered copy *before* the wait) publishes a new value with
  a release store.

Contract: values only grow (one per step or layer); ``set`` must follow the writes the waiting
work depends on (the flag is a release, the kernel's volatile load the acquire); the counter
lives as long as the object. Capability: cupy, a CUDA device that can map host memory, and a
GPU that sees the host move the flag: :func:`unavailable` probes that once per device and
process (one bounded wait, released by the host) and says what is missing; :class:`DeviceFlag`
raises with the capability's text; nothing falls back silently. On the H200 lent to this
project (driver under gVisor) the first version of the wait never returned: the probe turns
such a machine into a clear refusal. Tested under ``pytest -m gpu`` only
(tests/computenode/test_device_wait.py); used by :mod:`lamina.computenode.polling` (replicas pre-launching their next slice).
"""
from __future__ import annotations

import ctypes
import threading
import time
import warnings

from lamina.transport.ring_memory import fence

# One module for every wait: a flag the host moves to a target (DeviceFlag), and the step
# mailbox's words (lamina.computenode.step_graphs). A whole step in one CUDA graph cannot bake
# flag values in: it replays the same arguments every step, so its kernels read the step's
# BASE word (written by the host before the launch) and add the layer's offset.
_SOURCE = r"""
__device__ void lamina_spin(const volatile unsigned long long* flag, unsigned long long target,
                            unsigned long long timeout_ns, volatile unsigned long long* timed_out) {
    unsigned long long start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    unsigned int backoff = 32;
    while (*flag < target) {
#if __CUDA_ARCH__ >= 700
        __nanosleep(backoff);
        if (backoff < 1024) backoff <<= 1;
#endif
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
        if (now - start > timeout_ns) {
            *timed_out = 1;
            break;
        }
    }
    __threadfence_system();
}

extern "C" __global__ void lamina_wait_flag(const volatile unsigned long long* flag,
                                            unsigned long long target,
                                            unsigned long long timeout_ns,
                                            volatile unsigned long long* timed_out) {
    lamina_spin(flag, target, timeout_ns, timed_out);
}

extern "C" __global__ void lamina_signal_word(volatile unsigned long long* word,
                                              const volatile unsigned long long* base,
                                              unsigned long long offset) {
    __threadfence_system();  // the layer's q/k/v (earlier kernels' writes) before the word
    *word = *base + offset;
    __threadfence_system();
}

extern "C" __global__ void lamina_wait_word(const volatile unsigned long long* word,
                                            const volatile unsigned long long* base,
                                            unsigned long long offset,
                                            unsigned long long timeout_ns,
                                            volatile unsigned long long* missed) {
    lamina_spin(word, *base + offset, timeout_ns, missed);
}
"""
_KERNEL = None
_MAILBOX_KERNELS: dict[str, object] = {}
_LOCK = threading.Lock()
WAIT_TIMEOUT_S = 60.0  # a flag that has not moved in a minute: the peer is gone, free the stream
PROBE_TIMEOUT_S = 2.0  # the probe's bounded wait (the host moves the flag after ~10 ms)
_PROBED: dict[int, str | None] = {}
_STREAMS: dict[int, object] = {}  # CUDA stream pointer -> cupy ExternalStream


def unavailable(device: int = 0) -> str | None:
    """Why device-side polling cannot run here (``None``: it can): the capability checks, then
    (once per device and process) :func:`probe`."""
    why = _capability(device)
    if why is None:
        if device not in _PROBED:
            _PROBED[device] = probe(device)
        why = _PROBED[device]
    return why


def probe(device: int = 0) -> str | None:
    """One bounded wait on a fresh flag, released by this thread 10 ms later: ``None`` if the
    GPU saw the release, else why not. Waits on the CPU at most ``PROBE_TIMEOUT_S`` + 3 s."""
    import torch

    try:
        flag = DeviceFlag(device)
        stream = torch.cuda.Stream(device)
        flag.wait(1, stream, timeout_s=PROBE_TIMEOUT_S)
        done = torch.cuda.Event()
        done.record(stream)
        time.sleep(0.01)
        flag.set(1)
        released = time.monotonic()
        deadline = released + PROBE_TIMEOUT_S + 3.0
        while not done.query():
            if time.monotonic() > deadline:
                return (f"device-side polling: a flag wait on CUDA device {device} neither saw "
                        f"the host's release nor timed out within {PROBE_TIMEOUT_S + 3.0:.0f} s")
            time.sleep(0.001)
        # by the mark, or by the clock where device writes to host memory are not seen either
        missed = flag.timed_out or time.monotonic() - released > PROBE_TIMEOUT_S / 2
        flag.close()
    except Exception as e:  # noqa: BLE001 - compile, launch or driver errors: the same verdict
        return f"device-side polling: the flag-wait probe failed on CUDA device {device}: {e}"
    if missed:
        return (f"device-side polling: CUDA device {device} did not see the host move a flag in "
                f"host-mapped memory within {PROBE_TIMEOUT_S:.0f} s (a sandboxed GPU driver, "
                "e.g. gVisor's, can cause this); run without device polling")
    return None


def _capability(device: int) -> str | None:
    """cupy, the device, and host-memory mapping (no GPU work)."""
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


def mailbox_kernel(name: str):
    """``lamina_signal_word`` or ``lamina_wait_word`` (cupy ``RawKernel``s, compiled once)."""
    with _LOCK:
        if name not in _MAILBOX_KERNELS:
            import cupy
            _MAILBOX_KERNELS[name] = cupy.RawKernel(_SOURCE, name)
        return _MAILBOX_KERNELS[name]


def launch_on(stream, kernel, args: tuple) -> None:
    """One thread of ``kernel(*args)`` on the torch CUDA ``stream`` (captured when the stream
    is capturing a graph); pointer arguments as Python ints."""
    import cupy

    with cupy.cuda.Device(stream.device.index or 0), _external(stream.cuda_stream):
        kernel((1,), (1,), tuple(cupy.uint64(a) for a in args))


def mapped_alias(buffer, device: int = 0):
    """``buffer`` (a CPU uint8 tensor over page-aligned host memory) registered with CUDA as
    mapped memory, and a CUDA uint8 tensor aliasing it (no copy: kernels reading or writing it
    reach the host's bytes). Returns ``(alias, unregister)``; call ``unregister`` once no
    device work uses the alias any more. Raises with :func:`unavailable`'s text where the
    device cannot map host memory."""
    why = _capability(device)
    if why is not None:
        raise RuntimeError(why)
    import cupy
    import torch

    rt = cupy.cuda.runtime
    ptr, n = buffer.data_ptr(), buffer.numel()
    with cupy.cuda.Device(device):
        rt.hostRegister(ptr, n, 0x01 | 0x02)  # cudaHostRegisterPortable | cudaHostRegisterMapped
        mem = cupy.cuda.UnownedMemory(_device_pointer(rt, ptr), n, buffer, device)
        arr = cupy.ndarray((n,), dtype=cupy.uint8, memptr=cupy.cuda.MemoryPointer(mem, 0))
    alias = torch.as_tensor(arr, device=f"cuda:{device}")

    def unregister() -> None:
        with cupy.cuda.Device(device):
            rt.hostUnregister(ptr)
    return alias, unregister


def _external(ptr: int):
    """cupy's handle of the CUDA stream ``ptr`` (made once per stream: waits are per layer).
    cupy 14 deprecates ``ExternalStream``, and cupy 13 lacks its successor."""
    stream = _STREAMS.get(ptr)
    if stream is None:
        import cupy

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            stream = _STREAMS[ptr] = cupy.cuda.ExternalStream(ptr)
    return stream


def _device_pointer(rt, host: int) -> int:
    """The device address of mapped host memory: ``cudaHostGetDevicePointer`` where cupy
    binds it, else ``cudaPointerGetAttributes``'s ``devicePointer`` (cupy 14 binds only this)."""
    get = getattr(rt, "hostGetDevicePointer", None)
    if get is not None:
        return int(get(host, 0))
    return int(rt.pointerGetAttributes(host).devicePointer)


class DeviceFlag:
    """One u64 counter in host-mapped memory that CUDA streams can wait on (module docstring)."""

    def __init__(self, device: int = 0) -> None:
        why = _capability(device)
        if why is not None:
            raise RuntimeError(why)
        import cupy

        rt = cupy.cuda.runtime
        self.device = device
        with cupy.cuda.Device(device):
            self._host = rt.hostAlloc(16, rt.hostAllocMapped)  # [counter, timed-out mark]
            self._dev = _device_pointer(rt, self._host)
        self._word = ctypes.c_uint64.from_address(self._host)
        self._missed = ctypes.c_uint64.from_address(self._host + 8)
        self._word.value = 0
        self._missed.value = 0
        self._closed = False

    @property
    def timed_out(self) -> bool:
        """Whether a wait on this flag gave up (its stream went on without the release)."""
        return bool(self._missed.value)

    def clear_timed_out(self) -> None:
        """Forget a wait that gave up (its error has been reported), so later waits are judged
        on their own."""
        self._missed.value = 0

    @property
    def value(self) -> int:
        return int(self._word.value)

    def set(self, value: int) -> None:
        """Publish ``value`` (>= the current one) to every stream waiting for it."""
        if value < self._word.value:
            raise ValueError(f"flag values only grow: {value} < {self._word.value}")
        fence()  # what the waiting work reads is written before the flag moves
        self._word.value = value

    def wait(self, target: int, stream=None, timeout_s: float | None = None) -> None:
        """Enqueue on ``stream`` (a ``torch.cuda.Stream``; default torch's current one) a wait
        until the counter is ``>= target``, at most ``timeout_s`` (default ``WAIT_TIMEOUT_S``;
        then :attr:`timed_out`). Returns at once."""
        timeout_s = WAIT_TIMEOUT_S if timeout_s is None else timeout_s
        import cupy
        import torch

        s = stream if stream is not None else torch.cuda.current_stream(self.device)
        with cupy.cuda.Device(self.device), _external(s.cuda_stream):
            _kernel()((1,), (1,), (cupy.uint64(self._dev), cupy.uint64(target),
                                   cupy.uint64(int(timeout_s * 1e9)), cupy.uint64(self._dev + 8)))

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
