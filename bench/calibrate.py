"""Fit the cost model to this machine and check it against measured ``lamina bench`` runs.

The same as ``lamina plan --calibrate`` (see :mod:`lamina.benchmark.calibrate` for what it
measures and writes: ``configs/calibration/<kind>.yaml`` and
``bench/results/calibration_<kind>.{json,md}``)::

    python bench/calibrate.py                       # ~10 minutes on 2 cores
    python bench/calibrate.py --batches 1 8 --contexts 128
"""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from lamina.benchmark.calibrate import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main())
