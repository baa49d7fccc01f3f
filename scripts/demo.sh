#!/usr/bin/env bash
# Installs everything and runs the main job on the builtin model.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
lamina generate --model smollm2 --compute 2 --memory 2 --prompt "The capital of France is" --max-tokens 24
