"""Fixtures every room uses: one real mosquitto per test session and federations of client processes on it; the
session-end check that no test left a process running. Helpers that are not fixtures live in edgefl_testkit/.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from edge_client.transport import LinkConfig
from edgefl_testkit.federation import end_federation, start_federation
from edgefl_testkit.mqtt import DEVICES, require_mosquitto
from server.broker import Broker, BrokerSettings
from server.orchestrator import Orchestrator

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


@pytest.fixture(scope="session")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Broker]:
    """A real mosquitto with the server user and devices c0..c9, anonymous access off."""
    require_mosquitto()
    settings = BrokerSettings(devices=list(DEVICES), allow_anonymous=False)
    b = Broker(tmp_path_factory.mktemp("broker"), settings).start()
    try:
        yield b
    finally:
        b.stop()


@pytest.fixture
def federation(broker: Broker, tmp_path: Path) -> Iterator[Callable[..., tuple[Orchestrator, dict]]]:
    """``build(job, clients=3, rounds=3, ...)``: client processes on the session broker and the server for them."""
    started: list[dict[str, subprocess.Popen]] = []

    def on_session_broker(cid: str) -> tuple[str, str]:
        return broker.url, (broker.devices.get(cid) or broker.add_device(cid)).password

    def build(job: str, clients: int = 3, rounds: int = 3, **settings: Any) -> tuple[Orchestrator, dict]:
        link = LinkConfig(broker.url, broker.server.username, broker.server.password)
        orch, procs = start_federation(tmp_path, link, on_session_broker, job, clients, rounds, **settings)
        started.append(procs)
        return orch, procs

    yield build
    for procs in started:
        end_federation(procs)
