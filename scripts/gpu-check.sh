#!/usr/bin/env bash
# One command for a lent GPU machine (issue 22). Uses only what such a machine has: torch,
# triton, cupy, transformers; no internet, no pip. Runs, in order:
#   1. pytest -m gpu                     (Triton kernels compiled, device polling, CUDA wire)
#   2. bench/kernels.py --device cuda    (Triton decode attention: GB/s, % of copy, MBU vs the
#                                         device's spec bandwidth; batch 1..256 x ctx 512..32k)
#   3. bench/e2e.py --device cuda:0      (decode tok/s: memory nodes on the GPU, then on the
#                                         CPU = NEO's layout), each against HF on the GPU, and
#                                         in-process with vs without CUDA graphs, processes
#                                         with vs without device-side polling
#   4. bench/gpu_report.py               (one JSON + one markdown table of all of it)
# Output: $OUT/gpu_check/ when $OUT is set (the device tool's folder), else
# bench/results/gpu_check/. Exit status: 0 all steps ran, 1 a step failed, 2 no GPU.
set -uo pipefail
cd "$(dirname "$0")/.."
DIR="${OUT:-bench/results}/gpu_check"
mkdir -p "$DIR"
if ! python -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu-check: torch sees no CUDA device" >&2
    exit 2
fi
python - <<'PY' | tee "$DIR/environment.txt"
import importlib, torch
print("device:", torch.cuda.get_device_name(), "| torch", torch.__version__)
for m in ("triton", "cupy", "transformers", "yaml", "tqdm", "matplotlib"):
    try:
        print(f"{m}:", getattr(importlib.import_module(m), "__version__", "present"))
    except ImportError as e:
        print(f"{m}: MISSING ({e})")
PY
status=0
step() {  # step NAME CMD...: run, keep its log, remember a failure, go on
    local name=$1; shift
    echo "== $name: $*"
    "$@" 2>&1 | tee "$DIR/$name.log"
    local rc=${PIPESTATUS[0]}
    echo "$rc" > "$DIR/$name.rc"
    [ "$rc" -eq 0 ] || status=1
}
step pytest_gpu python -m pytest -m gpu -q -p no:cacheprovider tests
step kernels python bench/kernels.py --device cuda --out "$DIR"
step e2e_gpu_memory python bench/e2e.py --device cuda:0 --memory 1 --batches 1 8 32 64 --cuda-graphs --device-polling --out "$DIR/gpu_memory"
step e2e_cpu_memory python bench/e2e.py --device cuda:0 --memory-device cpu --memory 1 --batches 1 8 32 64 --cuda-graphs --device-polling --out "$DIR/cpu_memory"
step report python bench/gpu_report.py "$DIR"
exit $status
