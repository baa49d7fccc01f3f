#!/usr/bin/env bash
# Installs everything and runs the fast test suite (what CI runs; GPU tests skip cleanly
# without a GPU). `--all` runs the slow tests too (real model, processes, Ray, lamina launch:
# ~35 minutes on 2 cores); other arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
if [ "${1:-}" = "--all" ]; then
    shift
    python -m pytest -q "$@"
elif [ $# -eq 0 ]; then
    python -m pytest -q -m "not slow"
else
    python -m pytest -q "$@"
fi
