"""Import lamina before anything loads torch, as a user's script does (lamina/omp.py notes the
OpenMP wait policy the user chose); keep this session's model splits in a temporary folder;
load CUDA modules eagerly (GPU machines), as a polling replica does."""
import atexit
import os
import shutil
import tempfile

# splits cached for this session only (children inherit it): tests' models live in temporary
# folders, so a shared cache would only grow
if "LAMINA_SPLIT_CACHE" not in os.environ:
    os.environ["LAMINA_SPLIT_CACHE"] = _dir = tempfile.mkdtemp(prefix="lamina-splits-")
    atexit.register(shutil.rmtree, _dir, ignore_errors=True)

# device-side polling needs every CUDA kernel loaded when the context starts (computenode/polling)
os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")

import lamina  # noqa: E402,F401


import pytest  # noqa: E402


@pytest.fixture
def kernels():
    """``kernels(name_or_config)``: this test process computes with those kernel choices
    (:class:`lamina.config.KernelConfig`, or its one-name form) until the test ends."""
    from lamina.config import KernelConfig, use_kernels

    saved = []

    def use(choice):
        k = KernelConfig.named(choice) if isinstance(choice, str) else choice
        previous = use_kernels(k)
        if not saved:
            saved.append(previous)

    yield use
    if saved:
        use_kernels(saved[0])
