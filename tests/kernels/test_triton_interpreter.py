"""Run the Triton kernel cases under ``TRITON_INTERPRET=1`` in a child pytest process.

``TRITON_INTERPRET`` must be set before triton is imported, so setting it in this process would
leak into every later test module; the child process keeps it contained.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


def test_triton_kernels_under_interpreter():  # ~30 s: in the fast set, so CI covers the kernels
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", LAMINA_KERNELS="triton",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-W",
           "ignore::RuntimeWarning", str(HERE / "triton_interp_cases.py")]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"interpreter cases failed:\n{out[-8000:]}"
    summary = out.strip().splitlines()[-1]
    passed = re.search(r"(\d+) passed", summary)
    assert passed and int(passed.group(1)) >= 20 and "skipped" not in summary, out[-2000:]
