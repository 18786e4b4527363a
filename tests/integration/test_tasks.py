"""A simulated fleet (client processes on a real mosquitto, and in-process) that imports the user's own model and task
factories and evaluates on both sides (issue 13). Tasks, factories and evaluation reports as units:
tests/unit/edge_client/learning/test_tasks.py."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from edge_client.learning.data import load_local_data, split_holdout
from edge_client.learning.factories import AllowedCode
from edgefl_testkit.federation import make_config, run_simulated
from edgefl_testkit.own import module_of
from server.broker import Broker
from server.datasets import load_dataset

pytestmark = pytest.mark.integration


# ------------------------------------------------------------------------------------------- simulated fleets
@pytest.mark.parametrize("mode", ["inprocess", "broker"])
def test_a_simulated_fleet_trains_the_users_model_and_both_evaluate(
    mode: str, broker: Broker, user_code: Path, tmp_path: Path
) -> None:
    """simulate's devices (processes or in-process) import the run's own model and task factories, and [eval] holdout
    gives them a held-out split; with mode both the server's test set is the target's and the devices'
    sample-weighted report sits beside it in every evaluated row."""
    name = module_of(user_code)
    AllowedCode.of([user_code]).activate()  # as edge-server simulate --model-path does
    rng = np.random.default_rng(0)
    x = rng.normal(size=(400, 3)).astype(np.float32)
    y = (x @ np.array([1.0, -2.0, 0.5], np.float32) + 0.1 * rng.normal(size=400)).astype(np.float32)
    np.savez(tmp_path / "linear.npz", x_train=x[:300], y_train=y[:300], x_test=x[300:], y_test=y[300:])
    model = {"factory": f"{name}:build", "width": 8, "input_shape": [3]}
    config = make_config(
        tmp_path, f"own-{mode}", 3, 3, dataset=str(tmp_path / "linear.npz"), model=model, simulation={"threads": 1}
    )
    config.task = {"factory": f"{name}:huber_task"}
    config.eval.mode, config.eval.every, config.eval.holdout = "both", 2, 0.2
    summary, ids, shards = run_simulated(mode, config, load_dataset(config.data.dataset, seed=0), broker)
    rows = [json.loads(line) for line in (Path(config.run.out) / "metrics.jsonl").read_text().splitlines()]
    splits = [split_holdout(load_local_data(s), 0.2, config.run.seed, c) for c, s in zip(ids, shards, strict=True)]
    held_out = sum(len(held) for _, held in splits)
    assert [r["clients_reported"] for r in rows] == [3, 3, 3]  # every device built the user's model and trained
    assert [("mae" in r, "client_eval" in r) for r in rows] == [(False, False), (True, True), (True, True)]
    for r in (rows[1], rows[2]):  # every 2nd round and the last
        assert sorted(r["client_eval"]["devices"]) == ids and r["client_eval"]["num_samples"] == held_out
        assert r["client_eval"]["mae"] > 0 and r["client_eval"]["loss"] > 0
    assert summary["evaluated_by"] == "server test set" and summary["target_metric"] == "mae"
    assert summary["final_mae"] == rows[-1]["mae"] and summary["final_client_eval"]["num_samples"] == held_out
