"""What every room has: the session-end check that no test left a process running, and a user's own code. The real
mosquitto and federations of client processes on it are fixtures of tests/integration/ only (its conftest.py): a unit
test cannot ask for them. Helpers that are not fixtures live in edgefl_testkit/.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from pathlib import Path

import psutil
import pytest

from edgefl_testkit.own import write_user_code

SESSION_MARK = "EDGEFL_TEST_SESSION"  # in the environment of every process the suite starts


def pytest_configure(config: pytest.Config) -> None:
    os.environ[SESSION_MARK] = uuid.uuid4().hex  # inherited by every process a test starts (env={**os.environ, ...})


def _left_behind() -> list[psutil.Process]:
    """Processes still carrying this session's mark: started by a test and never stopped (orphans included)."""
    mark = os.environ[SESSION_MARK]
    mine = {os.getpid(), *(p.pid for p in psutil.Process().parents())}
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.pid not in mine and proc.environ().get(SESSION_MARK) == mark:
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def _describe(proc: psutil.Process) -> str:
    try:
        return f"{proc.pid} {' '.join(proc.cmdline())[:300]}"
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return str(proc.pid)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Fail the run if a test left a process behind (a broker, a client, a server): it would outlive the suite on a
    developer's machine and take CPU from every later test. Those still running get 10 s to exit, then are killed."""
    _, alive = psutil.wait_procs(_left_behind(), timeout=10)
    if not alive:
        return
    lines = [_describe(p) for p in alive]
    for proc in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write("\n")
        reporter.write_sep("=", f"{len(lines)} process(es) left running by tests (killed now)", red=True)
        for line in lines:
            reporter.write_line(line)
    session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture
def user_code(tmp_path: Path) -> Path:
    """A directory with a user's module (its name: ``edgefl_testkit.own.module_of``): a model and a task factory."""
    return write_user_code(tmp_path)
