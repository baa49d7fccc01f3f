"""Importing lamina defaults the OpenMP wait policy to PASSIVE, keeps a user's choice, and
warns when starting processes if torch loaded first (its threads then spin)."""
import os
import subprocess
import sys

import pytest

PROBE = """
import os, sys, warnings
{first}
from lamina.omp import spinning, warn_if_spinning
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    warn_if_spinning(); warn_if_spinning()
print(os.environ.get("OMP_WAIT_POLICY"), spinning(), len(w))
"""


def _probe(first: str, **env: str) -> list[str]:
    clean = {k: v for k, v in os.environ.items()
             if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")}
    out = subprocess.run([sys.executable, "-c", PROBE.format(first=first)], env={**clean, **env},
                         capture_output=True, text=True, check=True).stdout
    return out.split()


@pytest.mark.parametrize("first, env, want", [
    ("import lamina", {}, ["PASSIVE", "False", "0"]),
    ("import torch, lamina", {}, ["PASSIVE", "True", "1"]),  # too late for this process: warn once
    ("import torch, lamina", {"OMP_WAIT_POLICY": "ACTIVE"}, ["ACTIVE", "False", "0"]),
    ("import lamina", {"GOMP_SPINCOUNT": "1000"}, ["None", "False", "0"]),
])
def test_wait_policy(first, env, want):
    assert _probe(first, **env) == want
