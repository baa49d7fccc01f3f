#!/usr/bin/env bash
# One command for a lent GPU machine (issue 22). Uses only what such a machine has: torch,
# triton, cupy, transformers; no internet, no pip. Runs, in order:
#   0. scripts/polling_probe.py          (host calls that block behind a device flag wait)
#   1. pytest -m gpu                     (Triton kernels compiled, device polling, CUDA wire)
#   2. bench/kernels.py --device cuda    (Triton decode attention: GB/s, % of copy, MBU vs the
#                                         device's spec bandwidth; batch 1..256 x ctx 512..32k)
#   3. bench/prefix.py --traces attention --attention-device cuda
#                                        (issue 45's row: decode attention of 64 requests
#                                         sharing a 2,000-token prefix, read once per step by
#                                         the Triton cascade, against each request its own KV)
#   4. bench/e2e.py --device cuda:0      (decode tok/s: memory nodes on the CPU = NEO's layout,
#                                         then on the GPU), each against HF on the GPU, and
#                                         in-process with vs without CUDA graphs, processes
#                                         with vs without device-side polling, and whole
#                                         decode steps as one graph each (memory nodes in
#                                         process and in processes of their own)
#   5. bench/neo.py --device cuda:0      (NEO's layout against the GPU alone where the GPU's
#                                         pool holds a quarter of the KV: issue 41's last row)
#   6. bench/gpu_report.py               (one JSON + one markdown table of all of it)
# Output: $OUT/gpu_check/ when $OUT is set (the device tool's folder), else
# bench/results/gpu_check/. Exit status: 0 all steps ran, 1 a step failed, 2 no GPU.
# Model: the builtin smollm2 where its GGUF is installed, else `lamina.models:smollm2_shaped`
# (the same architecture, seeded random weights: same speed, noise tokens); environment.txt
# says which. Knobs (environment), to fit a lease: GPU_CHECK_QUICK=1 (kernel --quick grid, e2e
# at batch 8 with 8 steps: a smoke run), GPU_CHECK_STEP_S (each step's time limit, default
# 600 s), GPU_CHECK_MODEL (the model), GPU_CHECK_TESTS (pytest paths, default tests),
# GPU_CHECK_BATCHES (e2e batch sizes, default "1 8 32 64"), GPU_CHECK_STEPS (e2e timed steps),
# GPU_CHECK_POLLING=0 (e2e without the device-polling setup, one model split less per run).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # a GPU machine has lamina only as this tree
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
MODEL="${GPU_CHECK_MODEL:-}"
if [ -z "$MODEL" ]; then
    if python -c "from lamina.models import _alias_gguf; _alias_gguf('smollm2')" 2>/dev/null; then
        MODEL=smollm2
    else
        MODEL=lamina.models:smollm2_shaped
    fi
fi
echo "model: $MODEL" | tee -a "$DIR/environment.txt"
if [ "${GPU_CHECK_QUICK:-0}" = 1 ]; then
    KQ=(--quick); EB=(--batches 8 --steps 8); PQ=(--reps 2); echo "mode: quick (smoke run)" | tee -a "$DIR/environment.txt"
else
    KQ=(--reps 5); PQ=(--reps 5); EB=(--batches ${GPU_CHECK_BATCHES:-1 8 32 64} ${GPU_CHECK_STEPS:+--steps "$GPU_CHECK_STEPS"})
fi
PYT=(-m gpu -q -p no:cacheprovider -rs)
python -c "import xdist" 2>/dev/null && PYT+=(-n 8)            # Triton compiles in parallel
# thread method: a test blocked inside a CUDA call (a wait that never returns) cannot take a
# signal; the thread method dumps every stack and ends that worker, and the run goes on
python -c "import pytest_timeout" 2>/dev/null && PYT+=(--timeout 120 --timeout-method thread)
LIMIT="${GPU_CHECK_STEP_S:-600}"
status=0
step() {  # step NAME CMD...: run, keep its log, remember a failure, go on
    local name=$1; shift
    echo "== $name: $*"
    local t0=$SECONDS
    timeout -k 10 "$LIMIT" "$@" 2>&1 | tee "$DIR/$name.log"
    local rc=${PIPESTATUS[0]}
    echo "$rc" > "$DIR/$name.rc"
    echo $((SECONDS - t0)) > "$DIR/$name.seconds"  # to size the next lease
    [ "$rc" -eq 0 ] || status=1
}
# which host calls block behind a pending flag wait, with lazy and eager module loading (~20 s)
step polling_probe_lazy env CUDA_MODULE_LOADING=LAZY python scripts/polling_probe.py
step polling_probe_eager env CUDA_MODULE_LOADING=EAGER python scripts/polling_probe.py
step pytest_gpu python -m pytest "${PYT[@]}" ${GPU_CHECK_TESTS:-tests}
POLL=(--device-polling)  # a broken flag kernel would hang the e2e runs: gpu tests must pass first
if [ "${GPU_CHECK_POLLING:-1}" = 0 ]; then
    POLL=(); echo "e2e without --device-polling: GPU_CHECK_POLLING=0" | tee -a "$DIR/environment.txt"
elif [ "$(cat "$DIR/pytest_gpu.rc")" != 0 ]; then
    POLL=(); echo "e2e without --device-polling: pytest -m gpu failed" | tee -a "$DIR/environment.txt"
fi
step kernels python bench/kernels.py --device cuda "${KQ[@]}" --out "$DIR"
step prefix_attention python bench/prefix.py --traces attention --attention-device cuda "${PQ[@]}" --out "$DIR"
step e2e_cpu_memory python bench/e2e.py --model "$MODEL" --device cuda:0 --memory-device cpu --memory 1 "${EB[@]}" --cuda-graphs "${POLL[@]}" --out "$DIR/cpu_memory"
step e2e_gpu_memory python bench/e2e.py --model "$MODEL" --device cuda:0 --memory 1 "${EB[@]}" --cuda-graphs "${POLL[@]}" --out "$DIR/gpu_memory"
NQ=(); [ "${GPU_CHECK_QUICK:-0}" = 1 ] && NQ=(--quick)
step neo python bench/neo.py --model "$MODEL" --device cuda:0 --memory-device "cpu:2-$(($(nproc) - 1))" --cuda-graphs "${NQ[@]}" --out "$DIR"
step report python bench/gpu_report.py "$DIR"
exit $status
