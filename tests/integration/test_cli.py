"""The command lines, run as real processes: help texts, error exits, `edge-server broker`, a refused device login."""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import psutil
import pytest

from edge_client.exits import ExitStatus
from edge_client.wire.topics import Topics
from edge_client.wire.transport import LinkConfig, MqttLink
from server.broker import Broker
from server.cli import BROKER_DIED

REPO = Path(__file__).resolve().parents[2]
TIMEOUT = 60.0
SERVER = [sys.executable, "-m", "server.cli"]
CLIENT = [sys.executable, "-m", "edge_client.cli"]


def run(cmd: list[str], env: dict[str, str] | None = None, timeout: float = TIMEOUT) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "COLUMNS": "200", **(env or {})}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO, env=full_env)


@pytest.mark.parametrize(
    ("cmd", "usage"),
    [
        (SERVER, "usage: edge-server"),
        ([*SERVER, "simulate"], "usage: edge-server simulate"),
        ([*SERVER, "run"], "usage: edge-server run"),
        ([*SERVER, "broker"], "usage: edge-server broker"),
        (CLIENT, "usage: edge-client"),
        ([*CLIENT, "run"], "usage: edge-client run"),
    ],
    ids=["edge-server", "simulate", "run", "broker", "edge-client", "client-run"],
)
def test_help_exits_zero_with_usage(cmd: list[str], usage: str) -> None:
    result = run([*cmd, "--help"])
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(usage)


def test_server_help_lists_the_commands() -> None:
    out = run([*SERVER, "--help"]).stdout
    for command in ("simulate", "run", "broker"):
        assert command in out


def test_simulate_help_lists_its_flags() -> None:
    out = run([*SERVER, "simulate", "--help"]).stdout
    for flag in (
        "--clients",
        "--algorithm",
        "--dataset",
        "--partition",
        "--rounds",
        "--local-steps",
        "--batch-size",
        "--lr",
        "--target-accuracy",
        "--seed",
        "--out",
        "--config",
    ):
        assert re.search(rf"(^|[\s,\[]){re.escape(flag)}\b", out), f"{flag} missing from simulate --help"


def test_client_run_help_lists_its_flags() -> None:
    out = run([*CLIENT, "run", "--help"]).stdout
    for flag in (
        "--broker",
        "--client-id",
        "--data",
        "--username",
        "--password-file",
        "--job",
        "--max-rounds",
        "--once",
    ):
        assert flag in out


def test_bad_config_key_exits_2_naming_the_key(tmp_path: Path) -> None:
    config = tmp_path / "bad.toml"
    config.write_text("[train]\nlocal_stepz = 5\n")
    result = run([*SERVER, "simulate", "--config", str(config), "--out", str(tmp_path / "out")])
    assert result.returncode == 2
    assert "train.local_stepz" in result.stderr
    assert "local_steps" in result.stderr  # the valid keys are listed
    assert not (tmp_path / "out").exists()  # nothing was started


def test_out_of_range_flag_exits_2_naming_the_key(tmp_path: Path) -> None:
    result = run([*SERVER, "simulate", "--rounds", "0", "--out", str(tmp_path / "out")])
    assert result.returncode == 2
    assert "run.rounds" in result.stderr and ">= 1" in result.stderr


def test_unknown_algorithm_exits_2_listing_valid_names(tmp_path: Path) -> None:
    # An external broker URL that is never reached: the algorithm is refused before the server connects.
    result = run(
        [
            *SERVER,
            "run",
            "--algorithm",
            "fedbogus",
            "--dataset",
            "digits",
            "--broker",
            "mqtt://127.0.0.1:9",
            "--out",
            str(tmp_path / "out"),
        ]
    )
    assert result.returncode == 2, result.stderr[-2000:]
    assert "fedbogus" in result.stderr
    assert "fedavg" in result.stderr  # the valid names are listed


class LineReader:
    """Reads a process's stdout on a thread so the test can wait for each line with a deadline."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.lines: queue.Queue[str | None] = queue.Queue()
        self._thread = threading.Thread(target=self._pump, args=(proc,), daemon=True)
        self._thread.start()

    def _pump(self, proc: subprocess.Popen) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def until(self, pattern: str, deadline: float) -> list[str]:
        """Lines up to and including the first that matches ``pattern``."""
        seen: list[str] = []
        while True:
            line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            if line is None:
                raise AssertionError(f"output ended before {pattern!r}; got {seen}")
            seen.append(line)
            if re.search(pattern, line):
                return seen


def test_broker_command_prints_credentials_and_stops_on_sigterm(broker: Broker, tmp_path: Path) -> None:
    # `broker` is not used: requesting it applies conftest's skip (developer machine) / fail (CI) without mosquitto
    workdir = tmp_path / "brk"
    proc = subprocess.Popen(
        [*SERVER, "broker", "--dir", str(workdir), "--devices", "pi-1,pi-2"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    try:
        lines = LineReader(proc).until(r"credentials written to", time.monotonic() + TIMEOUT)
        text = "\n".join(lines)
        url = re.search(r"listening at (mqtt://\S+)", text)
        assert url, text
        logins = dict(re.findall(r"login: (\S+) / (\S+)", text))
        assert set(logins) == {"edgefl-server", "pi-1", "pi-2"}
        assert str(workdir / "credentials.json") in text

        creds = json.loads((workdir / "credentials.json").read_text())
        assert creds["url"] == url.group(1)
        assert creds["server"] == {"username": "edgefl-server", "password": logins["edgefl-server"]}
        assert creds["devices"] == {
            "pi-1": {"username": "pi-1", "password": logins["pi-1"]},
            "pi-2": {"username": "pi-2", "password": logins["pi-2"]},
        }

        # the printed login works against the running broker
        link_config = LinkConfig(url.group(1), "pi-1", logins["pi-1"], connect_timeout_s=10)
        link = MqttLink(link_config, "pi-1", [Topics().down("pi-1")])
        link.start()
        link.stop()

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=TIMEOUT) == 0, proc.stderr.read() if proc.stderr else ""
        # the broker went down with the command: nothing listens on its port any more
        host, port, _ = LinkConfig(url.group(1)).endpoint()
        with pytest.raises(OSError), socket.create_connection((host, port), timeout=5):
            pass
    finally:
        if proc.poll() is None:  # a failed assertion: SIGTERM first, so the command stops its mosquitto
            proc.terminate()
            try:
                proc.wait(timeout=TIMEOUT)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def test_broker_command_exits_nonzero_when_its_mosquitto_dies(broker: Broker, tmp_path: Path) -> None:
    """A killed mosquitto is reaped and said, and the command exits with BROKER_DIED so that systemd restarts it."""
    proc = subprocess.Popen(
        [*SERVER, "broker", "--dir", str(tmp_path / "brk"), "--devices", "pi-1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    try:
        LineReader(proc).until(r"credentials written to", time.monotonic() + TIMEOUT)
        (mosquitto,) = psutil.Process(proc.pid).children()
        mosquitto.kill()
        assert proc.wait(timeout=TIMEOUT) == BROKER_DIED
        assert proc.stderr is not None
        assert re.search(rf"mosquitto \(pid {mosquitto.pid}\) was killed by signal 9", proc.stderr.read())
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_client_with_wrong_password_exits_refused_naming_the_login(broker: Broker, tmp_path: Path) -> None:
    data = tmp_path / "shard.npz"
    rng = np.random.default_rng(0)
    np.savez(data, x=rng.normal(size=(16, 8)).astype(np.float32), y=rng.integers(0, 3, size=16))
    result = run(
        [
            *CLIENT,
            "run",
            "--broker",
            broker.url,
            "--client-id",
            "c5",
            "--data",
            str(data),
            "--job",
            "cli-badpw",
            "--threads",
            "1",
        ],
        env={"EDGEFL_PASSWORD": "not-" + broker.devices["c5"].password},
    )
    assert result.returncode == ExitStatus.REFUSED, result.stderr[-2000:]  # the unit does not restart on it
    assert "'c5'" in result.stderr
    assert re.search(r"username and password", result.stderr), result.stderr[-2000:]


def test_a_waiting_server_prints_each_change_and_tells_its_devices_it_was_interrupted(
    broker: Broker, tmp_path: Path
) -> None:
    """Output that is not a terminal (a log file, systemd) gets a line per change of what `edge-server run` waits
    for; stopped (SIGTERM) before round 1, the server tells its devices the run was interrupted, not finished."""
    from server.datasets import load_dataset

    digits = load_dataset("digits").train
    data = tmp_path / "c3.npz"
    np.savez(data, x=digits.x[:40], y=digits.y[:40])
    job = "cli-waiting"
    flags = ["--dataset", "digits", "--min-clients", "2", "--job", job, "--out", str(tmp_path / "run"), "--rounds", "1"]
    server = subprocess.Popen(
        [*SERVER, "run", "--broker", broker.url, *flags],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env={**os.environ, "EDGEFL_PASSWORD": broker.server.password},
    )
    device = None
    try:
        server.stdout = server.stderr  # LineReader reads the console, which rich writes to stderr
        lines = LineReader(server)
        lines.until(r"^waiting for clients: 0/2 registered$", time.monotonic() + TIMEOUT)
        device = subprocess.Popen(
            [
                *CLIENT,
                "run",
                "--broker",
                broker.url,
                "--client-id",
                "c3",
                "--job",
                job,
                "--data",
                str(data),
                "--threads",
                "1",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            cwd=REPO,
            env={**os.environ, "EDGEFL_PASSWORD": broker.devices["c3"].password},
        )
        device.stdout = device.stderr
        device_lines = LineReader(device)
        assert (
            lines.until(r"waiting for clients", time.monotonic() + TIMEOUT)[-1] == "waiting for clients: 1/2 registered"
        )
        device_lines.until(r"registered with the server", time.monotonic() + TIMEOUT)
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=TIMEOUT) == 128 + signal.SIGTERM
        said = device_lines.until(r"run \S+ ended: |stop of run", time.monotonic() + TIMEOUT)[-1]
        assert said.endswith("ended: interrupted (SIGTERM)"), said
        device.send_signal(signal.SIGTERM)
        assert device.wait(timeout=TIMEOUT) == ExitStatus.FINISHED
    finally:
        for proc in (server, device):
            if proc is not None and proc.poll() is None:
                proc.terminate()
                proc.wait(timeout=TIMEOUT)
