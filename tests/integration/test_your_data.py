"""A newcomer's own data in simulate (issue 25), run as users run it: `edge-server simulate` on a CSV file, and devices
(client processes on a real mosquitto, and in-process) that evaluate with no holdout configured. The data set, the
split and the holdout as units: tests/unit/server/test_your_data.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from edgefl_testkit.federation import make_config, run_simulated
from edgefl_testkit.own import write_csv
from server.broker import Broker
from server.datasets import load_dataset

pytestmark = pytest.mark.integration


def test_simulate_trains_on_a_csv_file(tmp_path: Path) -> None:
    """``edge-server simulate --dataset all.csv --label-column label``: accepted, and the standardised features train
    to the accuracy the data allows (raw, the 1000-scale feature blows SGD up)."""
    write_csv(tmp_path / "all.csv")
    out = tmp_path / "run"
    cmd = [
        sys.executable, "-m", "server.cli", "simulate", "--in-process", "--dataset", str(tmp_path / "all.csv"),
        "--label-column", "label", "--clients", "2", "--rounds", "3", "--local-steps", "10", "--batch-size", "16",
        "--out", str(out), "--job", "csv-simulate",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["dataset"] == "all.csv" and summary["final_accuracy"] >= 0.9, summary


@pytest.mark.parametrize("mode", ["inprocess", "broker"])
def test_simulate_with_devices_evaluating_and_no_holdout_evaluates(mode: str, broker: Broker, tmp_path: Path) -> None:
    """[eval] mode = "clients" without [eval] holdout: every round is evaluated by the devices (it was by none)."""
    config = make_config(tmp_path, f"no-holdout-{mode}", 2, 2, train={"local_steps": 5})
    config.eval.mode = "clients"
    summary, ids, _ = run_simulated(mode, config, load_dataset("digits", seed=0), broker)
    rows = [json.loads(line) for line in (Path(config.run.out) / "metrics.jsonl").read_text().splitlines()]
    assert [sorted(r["client_eval"]["devices"]) for r in rows] == [ids, ids]
    assert summary["evaluated_by"] == "devices' held-out splits" and summary["final_client_eval"]["accuracy"] > 0
