"""End to end over a real mosquitto with real `edge-client` processes training on real data (digits)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from edge_client.topics import Topics
from edge_client.transport import LinkConfig
from server.broker import Broker
from server.config import RunConfig, from_dict
from server.datasets import load_dataset
from server.evaluation import Evaluator
from server.orchestrator import Orchestrator
from server.simulate import ClientLogin, client_ids, prepare_shards, start_clients, stop_clients

pytestmark = pytest.mark.integration
CHANCE = 0.1  # ten classes


class Hooks:
    """Observer that runs a test's action after a given round, on the orchestrator's own thread."""

    def __init__(self, actions: dict[int, Callable[[], None]] | None = None) -> None:
        self.actions = actions or {}
        self.rows: list[dict[str, Any]] = []

    def waiting(self, text: str) -> None:
        pass

    def round_done(self, row: dict[str, Any]) -> None:
        self.rows.append(row)
        if row["round"] in self.actions:
            self.actions[row["round"]]()


def make_config(tmp_path: Path, job: str, clients: int, rounds: int, **clients_section: Any) -> RunConfig:
    return from_dict(
        {
            "run": {"rounds": rounds, "out": str(tmp_path / "run"), "job": job, "target_accuracy": 0.5},
            "clients": {"count": clients, "register_timeout_s": 60.0, **clients_section},
            "data": {"dataset": "digits", "partition": "iid"},
            "train": {"local_steps": 20, "batch_size": 32, "lr": 0.1},
        }
    )


@pytest.fixture
def federation(broker: Broker, tmp_path: Path) -> Iterator[Callable[..., tuple[Orchestrator, dict]]]:
    """Start client processes c0..c{n-1} on the session broker and build the server for them."""
    started: list[dict[str, subprocess.Popen]] = []

    def build(job: str, clients: int = 3, rounds: int = 3, **clients_section: Any) -> tuple[Orchestrator, dict]:
        config = make_config(tmp_path, job, clients, rounds, **clients_section)
        bundle = load_dataset("digits", seed=0)
        out = Path(config.run.out)
        shards, _ = prepare_shards(bundle, client_ids(clients), "iid", 0, out / "shards")
        logins = {}
        for cid in client_ids(clients):  # each device logs in as itself: the ACL allows nothing else
            creds = broker.devices.get(cid) or broker.add_device(cid)
            logins[cid] = ClientLogin(cid, creds.password)
        procs = start_clients(config, broker.url, logins, shards, out / "clients")
        started.append(procs)
        link = LinkConfig(broker.url, broker.server.username, broker.server.password)
        orch = Orchestrator(
            config, link, Evaluator(bundle.model, bundle.test), bundle.model, out, summary_extra={"dataset": "digits"}
        )
        return orch, procs

    yield build
    for procs in started:
        for proc in procs.values():  # a test may have stopped one: let it die normally
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGCONT)
        stop_clients(procs, timeout=20)


def test_fedavg_trains_over_mosquitto_above_chance(federation) -> None:
    orch, procs = federation("train")
    summary = orch.run()
    assert summary["rounds"] == 3
    assert summary["final_accuracy"] > CHANCE + 0.5, summary
    rows = [json.loads(line) for line in (orch.out_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [1, 2, 3]
    for row in rows:
        assert row["clients_reported"] == 3 and row["missing"] == []
        for client in row["clients"].values():
            assert client["local_steps"] == 20
            assert client["compute_s"] > 0 and client["bytes_up"] > 0 and client["bytes_down"] > 0
    assert (orch.out_dir / "summary.json").exists() and (orch.out_dir / "report.png").stat().st_size > 0
    # the clients exit on the server's stop message
    assert stop_clients(procs, timeout=30) == {cid: 0 for cid in procs}


def test_garbage_payload_mid_run_is_rejected_and_run_completes(federation, broker, mqtt_client_factory) -> None:
    orch, _ = federation("garbage")
    intruder = mqtt_client_factory("c9", broker.devices["c9"].password, "intruder")
    up = Topics("garbage").up("c9")

    def inject() -> None:
        intruder.publish(up, b"\x00\xffnot msgpack at all", qos=1).wait_for_publish(5)
        intruder.publish(up, b"\x93\x01\x02", qos=1).wait_for_publish(5)  # valid msgpack, not a header map

    hooks = Hooks({1: inject})
    orch.observer = hooks
    summary = orch.run()
    assert summary["rounds"] == 3
    assert summary["rejected"].get("malformed", 0) == 2
    assert sum(sum(r["rejected"].values()) for r in hooks.rows[1:]) == 2
    assert all(r["clients_reported"] == 3 for r in hooks.rows)
    assert summary["final_accuracy"] > CHANCE + 0.5


def test_frozen_and_killed_clients_do_not_stall_rounds(federation) -> None:
    orch, procs = federation("faults", clients=3, rounds=4, round_deadline_s=4.0)

    def freeze_c2() -> None:  # connection stays up, no last will: only the timer can close the round
        os.kill(procs["client-02"].pid, signal.SIGSTOP)

    def kill_c1() -> None:  # the broker publishes its last will: the server stops waiting for it
        procs["client-01"].kill()
        procs["client-01"].wait()

    hooks = Hooks({1: freeze_c2, 2: kill_c1})
    orch.observer = hooks
    summary = orch.run()
    rows = hooks.rows
    assert summary["rounds"] == 4
    assert rows[0]["missing"] == []
    assert rows[1]["missing"] == ["client-02"] and rows[1]["clients_reported"] == 2
    assert "client-00" in rows[3]["clients"]
    assert "client-01" not in rows[3]["clients"] and "client-02" not in rows[3]["clients"]


def test_simulate_command_end_to_end(tmp_path: Path) -> None:
    out = tmp_path / "sim"
    cmd = [
        sys.executable,
        "-m",
        "server.cli",
        "simulate",
        "--clients",
        "3",
        "--rounds",
        "3",
        "--dataset",
        "digits",
        "--local-steps",
        "20",
        "--out",
        str(out),
        "--target-accuracy",
        "0.8",
    ]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["rounds"] == 3 and summary["final_accuracy"] > CHANCE + 0.5
    for key in (
        "wall_clock_s",
        "target_accuracy",
        "rounds_to_target",
        "time_to_target_s",
        "client_compute_to_target_s",
    ):
        assert key in summary
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 3
    assert (out / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "round   3/3" in result.stderr
