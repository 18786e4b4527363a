"""The orchestrator's runs over the real broker, against a fake device (its own login on the session's mosquitto): a
late update rejected and never aggregated, and round t's evaluation running beside round t+1. Its checks of each
message, in-process: tests/unit/server/test_orchestrator.py."""

from __future__ import annotations

import dataclasses
import json
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from edge_client.wire.messages import Assignment, new_msg_id
from edge_client.wire.protocol import encode
from edge_client.wire.transport import LinkConfig
from edgefl_testkit.fakes import FakeDevice, zero_update
from edgefl_testkit.orchestrator import initial_weights, small_run_config
from server.broker import Broker
from server.datasets import DatasetBundle, load_dataset
from server.evaluation import Evaluator
from server.orchestrator import Orchestrator

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def digits() -> DatasetBundle:
    return load_dataset("digits", seed=0)


def late_then_valid(cid: str, late_round: int) -> Callable[[Assignment], list[bytes | bytearray]]:
    """Answers each assignment with a zero delta; right after round ``late_round`` begins it first sends a huge update
    for the round before it (as a client that finished that round late would), then its valid one."""

    def respond(a: Assignment) -> list[bytes | bytearray]:
        valid = zero_update(a, cid, 50)
        frames = [encode(valid)]
        if a.facts.round == late_round:
            huge = np.full(valid.delta.size, 1e6, dtype=np.float32)
            late = dataclasses.replace(
                valid, round=a.facts.round - 1, model_version=a.facts.model_version - 1, delta=huge, msg_id=new_msg_id()
            )
            frames.insert(0, encode(late))
        return frames

    return respond


def test_run_rejects_a_late_update_and_does_not_aggregate_it(broker: Broker, digits, tmp_path: Path) -> None:
    job = f"o{uuid.uuid4().hex[:10]}"
    config = small_run_config(tmp_path, job, rounds=3, count=1)
    link = LinkConfig(broker.url, broker.server.username, broker.server.password)
    out = tmp_path / "run"
    orch = Orchestrator(config, link, Evaluator(digits.model, digits.test), digits.model, out)
    creds = broker.devices["c0"]
    fake = FakeDevice.over_mqtt(broker.url, creds.username, creds.password, job, "c0", 50, late_then_valid("c0", 2))
    fake.start()
    try:
        summary = orch.run()
    finally:
        fake.stop(timeout=30)
    assert not fake._thread.is_alive()
    assert fake.error is None, fake.error
    assert fake.stopped_by_server.is_set()
    assert [(a.facts.round, a.facts.model_version) for a in fake.assignments] == [(1, 0), (2, 1), (3, 2)]

    assert summary["rounds"] == 3
    assert summary["rejected"] == {"out_of_round": 1}
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [1, 2, 3]
    assert [r["rejected"] for r in rows] == [{}, {"out_of_round": 1}, {}]
    assert all(r["clients_reported"] == 1 and r["missing"] == [] for r in rows)

    w0 = initial_weights(digits.model)
    with np.load(out / "checkpoint.npz") as ckpt:
        np.testing.assert_array_equal(ckpt["weights"], w0)  # zero deltas only: the 1e6 one never got in
        assert int(ckpt["round"]) == 3 and int(ckpt["model_version"]) == 3
    tested = Evaluator(digits.model, digits.test)(w0)
    acc0, loss0 = tested["accuracy"], tested["loss"]
    assert all(r["accuracy"] == acc0 and r["loss"] == pytest.approx(loss0) for r in rows)


def test_round_t_is_evaluated_while_round_t_plus_1_trains(broker: Broker, digits, tmp_path: Path) -> None:
    """The evaluation of round t's model waits for round t+1's assignment to reach the device: it can finish only if
    it runs beside that round, not between the rounds. The rows still come one per round, in order, each stamped with
    the time its model was produced (before the next round began) and evaluated on that model."""
    job = f"o{uuid.uuid4().hex[:10]}"
    rounds = 3
    config = small_run_config(tmp_path, job, rounds=rounds, count=1)
    link = LinkConfig(broker.url, broker.server.username, broker.server.password)
    assigned = {r: threading.Event() for r in range(1, rounds + 2)}
    assigned_at: dict[int, float] = {}
    saw_next_round: list[bool] = []

    class Gated(Evaluator):
        def __call__(self, weights: np.ndarray) -> dict[str, float]:
            round_ = len(saw_next_round) + 1  # FedAvg has no other outputs: one call per round
            saw_next_round.append(round_ == rounds or assigned[round_ + 1].wait(timeout=60))
            return super().__call__(weights)

    def respond(a: Assignment) -> list[bytes | bytearray]:
        assigned_at.setdefault(a.facts.round, time.monotonic())
        assigned[a.facts.round].set()
        return [encode(zero_update(a, "c0", 50))]

    out = tmp_path / "run"
    orch = Orchestrator(config, link, Gated(digits.model, digits.test), digits.model, out)
    creds = broker.devices["c0"]
    fake = FakeDevice.over_mqtt(broker.url, creds.username, creds.password, job, "c0", 50, respond)
    fake.start()
    start = time.monotonic()
    try:
        summary = orch.run()
    finally:
        fake.stop(timeout=30)
    assert summary["rounds"] == rounds and saw_next_round == [True] * rounds
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [1, 2, 3]
    for r in rows[:-1]:  # produced before the device got the next round's assignment
        assert start + r["elapsed_s"] < assigned_at[r["round"] + 1], r
    tested = Evaluator(digits.model, digits.test)(initial_weights(digits.model))
    assert all(r["accuracy"] == tested["accuracy"] and r["loss"] == pytest.approx(tested["loss"]) for r in rows)
    assert all(r["eval_s"] >= 0 for r in rows)
