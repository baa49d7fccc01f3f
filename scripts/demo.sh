#!/usr/bin/env bash
# Installs everything and runs the main job on the builtin model.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
lamina split smollm2 --check
