#!/usr/bin/env bash
# Installs everything and runs the test suite (GPU tests skip cleanly without a GPU).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
python -m pytest -q "$@"
