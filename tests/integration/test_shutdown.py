"""A stopped `edge-server` stops everything it started: `kill` (SIGTERM) or a closed terminal (SIGHUP) to `simulate`
ends its mosquitto and its `edge-client` processes, and `run` ends the mosquitto it started, as Ctrl-C does."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest

from edgefl_testkit.mqtt import require_mosquitto


def _poll(check: Callable[[], bool], proc: subprocess.Popen, timeout: float, what: str, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if proc.poll() is not None:
            raise AssertionError(f"edge-server exited ({proc.returncode}) before {what}:\n{log.read_text()[-2000:]}")
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout} s: {what}")
        time.sleep(0.1)


def _started(proc: subprocess.Popen) -> list[psutil.Process]:
    return psutil.Process(proc.pid).children(recursive=True)


def _names(procs: list[psutil.Process]) -> list[str]:
    out = []
    for p in procs:
        try:
            out.append(" ".join(p.cmdline()))
        except psutil.NoSuchProcess:
            continue
    return out


def _stop_and_check(proc: subprocess.Popen, signum: int, started: list[psutil.Process]) -> None:
    proc.send_signal(signum)
    try:
        code = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    _, alive = psutil.wait_procs(started, timeout=15)
    for p in alive:  # do not leave them to the next test either
        p.kill()
    assert code == 128 + signum
    assert not alive, f"left running after {signal.Signals(signum).name}: {_names(alive)}"


@pytest.mark.integration
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_a_signalled_simulate_stops_its_broker_and_clients(tmp_path: Path, signum: int) -> None:
    require_mosquitto()
    run_dir = tmp_path / "run"
    log = tmp_path / "simulate.log"
    with log.open("w") as fh:
        proc = subprocess.Popen(
            [sys.executable, "-m", "server.cli", "simulate", "--dataset", "digits", "--clients", "2",
             "--rounds", "500", "--local-steps", "5", "--out", str(run_dir)],
            stdout=fh, stderr=subprocess.STDOUT,
        )  # fmt: skip
    metrics = run_dir / "metrics.jsonl"
    _poll(lambda: metrics.exists() and metrics.stat().st_size > 0, proc, 120, "the first round was recorded", log)
    started = _started(proc)
    commands = _names(started)
    assert any("mosquitto" in c for c in commands), commands
    assert sum("edge_client.cli" in c for c in commands) == 2, commands
    _stop_and_check(proc, signum, started)


@pytest.mark.integration
def test_a_signalled_run_stops_the_broker_it_started(tmp_path: Path) -> None:
    require_mosquitto()
    log = tmp_path / "run.log"
    with log.open("w") as fh:
        proc = subprocess.Popen(
            [sys.executable, "-m", "server.cli", "run", "--dataset", "digits", "--out", str(tmp_path / "run")],
            stdout=fh, stderr=subprocess.STDOUT,
        )  # fmt: skip
    _poll(lambda: "started mosquitto at" in log.read_text(), proc, 60, "the broker was started", log)
    started = _started(proc)
    assert any("mosquitto" in c for c in _names(started))
    _stop_and_check(proc, signal.SIGTERM, started)
