"""ProcessLauncher: roles forked from the fork server see the engine's environment as it is
when they start, name themselves in ``ps`` and run their exit handlers when they end; the spare
role process runs the next role it is handed (the role's pid is the spare's); close stops a
spare still waiting."""
import atexit
import os
import time

import pytest

from lamina.config import deployment_config
from lamina.instance.launcher import ProcessLauncher


def report(path, tag):
    with open(path, "a") as f:
        f.write(f"{tag} {os.getpid()}\n")


def _lines(path, n, timeout=120.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        lines = path.read_text().splitlines() if path.exists() else []
        if len(lines) >= n:
            return lines
        time.sleep(0.05)
    raise TimeoutError(f"{path}: fewer than {n} lines")


def report_env_and_exit(path, name):
    """A role: write ``name``'s value now, and ``exit`` from an exit handler."""
    atexit.register(report, path, "exit")
    report(path, f"{name}={os.environ.get(name)}")


def test_a_role_sees_the_environment_at_its_start_and_runs_its_exit_handlers(tmp_path,
                                                                             monkeypatch):
    launcher = ProcessLauncher()
    q = tmp_path / "roles.txt"
    name = "LAMINA_TEST_LAUNCHER_VAR"
    try:
        for i, value in enumerate(("one", "two")):  # the fork server started with "one"
            monkeypatch.setenv(name, value)
            p = launcher.start(report_env_and_exit, (q, name), f"lamina: test role {i}")
            p.join(60)
            assert p.exitcode == 0
            assert _lines(q, 2 * i + 2)[2 * i:] == [f"{name}={value} {p.pid}", f"exit {p.pid}"]
    finally:
        launcher.close()


def report_title(path):
    with open("/proc/self/cmdline") as f:
        report(path, "title=" + f.read().replace("\0", " ").strip())


def test_a_role_names_itself_in_ps(tmp_path):
    """The title is set before the role takes the engine's environment: ``setproctitle``
    finds the command line's memory through the environment the process started with, and
    after ``os.environ.clear()`` it silently set nothing."""
    launcher = ProcessLauncher()
    q = tmp_path / "roles.txt"
    try:
        p = launcher.start(report_title, (q,), "lamina: test role")
        p.join(60)
        assert _lines(q, 1)[0] == f"title=lamina: test role {p.pid}"
    finally:
        launcher.close()


def test_a_spare_runs_the_next_role_and_close_stops_the_one_waiting(tmp_path):
    launcher = ProcessLauncher()
    q = tmp_path / "roles.txt"  # a spare is handed its role over a pipe: plain data only
    try:
        launcher.keep_spare()
        spare, pipe = launcher._spare
        launcher.keep_spare()  # one is enough
        assert launcher._spare[0] is spare
        deadline = time.monotonic() + 120
        while not pipe.poll() and time.monotonic() < deadline:  # its imports take a while
            time.sleep(0.05)
        p = launcher.start(report, (q, "role"), "lamina: test role")
        assert p is spare and launcher._spare is None and p.name == "lamina: test role"
        assert _lines(q, 1)[0] == f"role {spare.pid}"
        p.join(30)
        assert not p.is_alive()
        fresh = launcher.start(report, (q, "no spare"), "lamina: test role 2")  # spawned
        assert _lines(q, 2)[1] == f"no spare {fresh.pid}" and fresh is not spare
        fresh.join(30)
        launcher.keep_spare()
        waiting = launcher._spare[0]
    finally:
        launcher.close()
    waiting.join(10)
    assert not waiting.is_alive() and launcher._spare is None


def test_spare_is_for_role_processes_only():
    with pytest.raises(ValueError, match="spare"):
        deployment_config("m", spare=True)  # placement inproc
    assert deployment_config("m", spare=True, placement="procs").instance.spare
