"""End to end over a real mosquitto with real `edge-client` processes training on real data (digits)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from edge_client.learning.predictor import Predictor
from edge_client.wire.topics import Topics
from edgefl_testkit.basics import CHANCE
from edgefl_testkit.federation import Hooks
from server.datasets import load_dataset
from server.experiments.simulate import stop_clients

pytestmark = pytest.mark.integration


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

    hooks = Hooks({1: inject}).attach(orch)
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

    hooks = Hooks({1: freeze_c2, 2: kill_c1}).attach(orch)
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
    # the exported ONNX models: the final one classifies the test set exactly as the server evaluated it
    test = load_dataset("digits", seed=0).test
    final = Predictor(out / "model-final.onnx")
    assert (final.predict(test.x) == test.y).mean() == pytest.approx(summary["final_accuracy"], abs=1e-9)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    best_round = max(rows, key=lambda r: r["accuracy"])["round"]
    assert Predictor(out / "model.onnx").meta["round"] == best_round  # model.onnx: the best round's model


def test_device_fetches_the_exported_model(federation, broker) -> None:
    orch, _ = federation("fetch", clients=2, rounds=2)
    orch.run()
    out = orch.out_dir / "device" / "model.onnx"
    env = {**os.environ, "EDGEFL_PASSWORD": broker.devices["client-00"].password}
    cmd = [sys.executable, "-m", "edge_client.cli", "fetch-model", "--broker", broker.url, "--client-id", "client-00",
           "--job", "fetch", "--out", str(out)]  # fmt: skip
    result = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    assert out.read_bytes() == (orch.out_dir / "model.onnx").read_bytes()  # the best model, byte for byte
    test = load_dataset("digits", seed=0).test
    rows = [json.loads(line) for line in (orch.out_dir / "metrics.jsonl").read_text().splitlines()]
    best = max(rows, key=lambda r: r["accuracy"])
    assert (Predictor(out).predict(test.x) == test.y).mean() == pytest.approx(best["accuracy"], abs=1e-9)
