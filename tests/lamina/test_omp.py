"""The OpenMP wait policy: the process that imports lamina keeps libgomp's default (it owns its
cores in process); role processes start PASSIVE; a user's choice is left alone everywhere."""
import os
import subprocess
import sys

import pytest

PROBE = """
import os
{first}
from lamina import omp
before = os.environ.get("OMP_WAIT_POLICY")
omp.for_roles()
print(before, os.environ.get("OMP_WAIT_POLICY"), os.environ.get("GOMP_SPINCOUNT"))
"""


def _probe(first: str, **env: str) -> list[str]:
    clean = {k: v for k, v in os.environ.items()
             if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")}
    out = subprocess.run([sys.executable, "-c", PROBE.format(first=first)], env={**clean, **env},
                         capture_output=True, text=True, check=True).stdout
    return out.split()


@pytest.mark.parametrize("first, env, want", [
    ("import lamina", {}, ["None", "PASSIVE", "None"]),  # this process: default; roles: PASSIVE
    ("import torch, lamina", {}, ["None", "PASSIVE", "None"]),
    ("import torch, lamina", {"OMP_WAIT_POLICY": "ACTIVE"}, ["ACTIVE", "ACTIVE", "None"]),
    ("import lamina", {"GOMP_SPINCOUNT": "1000"}, ["None", "None", "1000"]),  # a choice: kept
])
def test_wait_policy(first, env, want):
    assert _probe(first, **env) == want


def test_role_processes_start_passive(tmp_path):
    """A role process spawned by the launcher sees PASSIVE (before its torch loads)."""
    code = """
import multiprocessing, os
from lamina.instance.launcher import ProcessLauncher

def show(q):
    q.put(os.environ.get("OMP_WAIT_POLICY"))

if __name__ == "__main__":
    q = multiprocessing.get_context("spawn").Queue()
    p = ProcessLauncher().start(show, (q,), "probe")
    print(q.get(timeout=60)); p.join(30)
"""
    clean = {k: v for k, v in os.environ.items()
             if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")}
    script = tmp_path / "probe.py"  # spawn re-imports the main module: a file, not -c
    script.write_text(code)
    out = subprocess.run([sys.executable, str(script)], env=clean, capture_output=True,
                         text=True, check=True, timeout=120).stdout
    assert out.split()[-1] == "PASSIVE"
