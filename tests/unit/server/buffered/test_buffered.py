"""Buffered asynchronous aggregation (issue 28): configuration, the staleness weighting, the buffer's step and the
event clock on hand-made speeds. The loop over a real broker is tested in tests/integration/test_buffered_fleet.py."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from edge_client.algorithms import CONTRACTS
from edge_client.algorithms.contract import buffered_markdown
from edge_client.wire.messages import Update
from server.buffered.clock import EventClock
from server.buffered.staleness import Stale, server_step, staleness_of, staleness_weight, weighted
from server.config import ConfigError, from_dict
from server.strategies import TrainSettings, make_strategy

REPO = Path(__file__).resolve().parents[4]


def test_every_contract_says_whether_it_runs_buffered_and_why_and_the_docs_table_is_theirs() -> None:
    assert {n for n, c in CONTRACTS.items() if c.buffered} == {"fedavg", "fedprox", "fednova"}
    assert all(len(c.buffered_why) > 40 for c in CONTRACTS.values())
    assert buffered_markdown(CONTRACTS.values()) in (REPO / "docs" / "algorithms.md").read_text()


@pytest.mark.parametrize("name", sorted(n for n, c in CONTRACTS.items() if not c.buffered))
def test_an_algorithm_that_cannot_run_buffered_is_refused_at_load_with_its_reason(name: str) -> None:
    with pytest.raises(ConfigError, match=r"train.mode = 'buffered' cannot run") as err:
        from_dict({"train": {"mode": "buffered", "algorithm": name}})
    assert CONTRACTS[name].buffered_why in str(err.value) and "fedavg, fednova, fedprox" in str(err.value)


@pytest.mark.parametrize(
    ("train", "message"),
    [
        ({"mode": "async"}, r"train.mode must be 'synchronous' or 'buffered'; got 'async'"),
        ({"buffer_size": 0}, r"train.buffer_size must be an integer >= 1"),
        ({"concurrency": -1}, r"train.concurrency must be an integer >= 0"),
        ({"server_lr": 0.0}, r"train.server_lr must be a number > 0"),
        ({"staleness_weight": "linear"}, r"train.staleness_weight must be 'sqrt' or 'polynomial' or 'constant'"),
        ({"max_staleness": -1}, r"train.max_staleness must be an integer >= 0"),
    ],
)
def test_buffered_keys_are_validated_naming_the_key(train: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        from_dict({"train": train})


def test_buffered_refuses_what_it_does_not_do_naming_the_fix() -> None:
    assert from_dict({"train": {"mode": "buffered", "algorithm": "fednova"}}).train.mode == "buffered"
    with pytest.raises(ConfigError, match=r"clients.fraction = 0.5 .* set train.concurrency"):
        from_dict({"train": {"mode": "buffered"}, "clients": {"fraction": 0.5}})
    with pytest.raises(ConfigError, match=r"eval.mode = 'clients'.*use eval.mode = 'server'"):
        from_dict({"train": {"mode": "buffered"}, "eval": {"mode": "clients"}})
    with pytest.raises(ConfigError, match=r"privacy.mode = 'central': .* privacy.mode = 'off'"):
        from_dict({"train": {"mode": "buffered"}, "privacy": {"mode": "central", "noise_multiplier": 1.0,
                                                              "clip_norm": 1.0}})  # fmt: skip
    with pytest.raises(ConfigError, match=r"privacy.secure_aggregation = true: .* privacy.secure_aggregation = false"):
        from_dict({"train": {"mode": "buffered"}, "privacy": {"secure_aggregation": True}})


def test_the_staleness_weights_are_the_formulas() -> None:
    for s in (0, 1, 3, 8):
        assert staleness_weight("sqrt", s) == pytest.approx(1 / math.sqrt(1 + s))
        assert staleness_weight("polynomial", s, 1.0) == pytest.approx(1 / (1 + s))
        assert staleness_weight("constant", s) == 1.0
    assert staleness_weight("polynomial", 3, 0.5) == staleness_weight("sqrt", 3)
    with pytest.raises(ValueError, match="cannot be trained on a version not yet made"):
        staleness_weight("sqrt", -1)


def test_an_update_beyond_max_staleness_is_refused_naming_the_versions() -> None:
    assert staleness_of("pi3", trained_on=4, current=6, max_staleness=2) == 2
    with pytest.raises(Stale, match=r"pi3 trained on model version 3, 3 versions before the current 6") as err:
        staleness_of("pi3", trained_on=3, current=6, max_staleness=2)
    assert err.value.reason == "staleness"


def update(cid: str, delta: list[float]) -> Update:
    return Update(round=1, model_version=0, client_id=cid, num_samples=10, local_steps=5, compute_s=1.0,
                  cpu_s=1.0, train_loss=0.1, delta=np.array(delta, dtype=np.float32))  # fmt: skip


def test_a_buffer_steps_by_server_lr_times_the_staleness_weighted_mean() -> None:
    """FedAvg (uniform) over a buffer of K = 2: w - eta_g (w(0) d_a + w(3) d_b) / 2."""
    strategy = make_strategy("fedavg", TrainSettings(5, 0.1, 8), {}, 0)
    w = np.array([1.0, 2.0], dtype=np.float32)
    rnd = strategy.begin(1, w)
    fresh, stale = update("a", [0.4, 0.0]), update("b", [0.0, 0.8])
    strategy.fold(rnd, weighted(fresh, staleness_weight("sqrt", 0)))
    strategy.fold(rnd, weighted(stale, staleness_weight("sqrt", 3)))
    new = server_step(w, strategy.finish(rnd), 0.5)
    expected = w - 0.5 * (np.array([0.4, 0.0]) + 0.5 * np.array([0.0, 0.8])) / 2
    np.testing.assert_allclose(new, expected, rtol=1e-6)
    assert fresh.delta[0] == np.float32(0.4)  # the update's own vector is not scaled in place


def test_the_event_clock_orders_updates_as_a_fleet_of_those_speeds_would() -> None:
    """A device of 1 s per update beside one of 3.5 s: the fast one's updates arrive at 1, 2, 3, then the slow one's
    at 3.5, then the fast one's at 4, whatever order they were placed in; transfers count."""
    clock, cycle = EventClock(), {"fast": (0.0, 0.8, 0.2), "slow": (0.5, 2.5, 0.5)}
    for cid in ("slow", "fast"):
        clock.started(cid)
        clock.place(cid, *cycle[cid])
    order = []
    while clock.now < 4.0:
        event = clock.pop()
        order.append((event.client_id, event.at))
        clock.started(event.client_id)  # sent its next assignment at once
        clock.place(event.client_id, *cycle[event.client_id])
    assert order == [("fast", 1.0), ("fast", 2.0), ("fast", 3.0), ("slow", 3.5), ("fast", 4.0)]
    assert clock.waiting() == set()


def test_an_inprocess_fleet_delivers_on_the_event_clock(tmp_path: Path) -> None:
    """pi5 beside two pi3 (in-process, K = 2): updates are taken in the order of their arrival on the event clock
    (start + download + compute + upload at the profile's rates), not in the order the bus ran the devices, so the
    pi5 delivers most of them; staleness and weights as the formula says."""
    import json

    from edgefl_testkit.federation import make_config, run_simulated
    from server.datasets import load_dataset

    config = make_config(tmp_path, "fb-clock", 3, 6, train={"mode": "buffered", "buffer_size": 2, "local_steps": 5})
    config.fleet.devices = "pi5:1,pi3:2"
    summary, _, _ = run_simulated("inprocess", config.validate(), load_dataset("digits", seed=0), None)  # type: ignore[arg-type]
    rows = [json.loads(line) for line in (tmp_path / "fb-clock" / "metrics.jsonl").read_text().splitlines()]
    updates = [u for r in rows for u in r["updates"]]
    arrivals = [u["arrived_s"] for u in updates]
    assert arrivals == sorted(arrivals) and len(updates) == 12
    for u in updates:
        phases = u["download_s"] + u["compute_s"] + u["upload_s"]
        assert u["arrived_s"] == pytest.approx(u["started_s"] + phases, abs=1e-2)  # + the server's aggregation CPU
    for r in rows:
        assert r["parallel_elapsed_s"] >= max(u["arrived_s"] for u in r["updates"])
        for u in r["updates"]:
            assert u["staleness"] == r["model_version"] - 1 - u["model_version"]
            assert u["weight"] == pytest.approx(1 / math.sqrt(1 + u["staleness"]))
    per_device = {cid: sum(u["client"] == cid for u in updates) for cid in ("client-00", "client-01", "client-02")}
    assert per_device["client-00"] > per_device["client-01"] + per_device["client-02"]
    assert summary["parallel_clock_s"] == rows[-1]["parallel_elapsed_s"]


def test_the_leaderboard_suite_has_the_buffered_rows() -> None:
    """`python -m benchmarks.fleet --leaderboard` runs fleet-noniid: buffered FedAvg, and FedNova buffered with the
    deadline steps policy, beside the synchronous rows, in every in-process column."""
    from server.experiments.suites import load_suite

    runs = {(r.column, r.algorithm): r.config for r in load_suite("fleet-noniid").runs()}
    for column in ("MNIST · dirichlet:0.3", "Fashion-MNIST · dirichlet:0.3"):
        plain, buffered = runs[(column, "fedavg")], runs[(column, "fedavg@buffered")]
        assert plain.train.mode == "synchronous" and buffered.train.mode == "buffered"
        assert buffered.train.buffer_size * buffered.run.rounds == plain.clients.count * plain.run.rounds
        nova = runs[(column, "fednova@buffered-deadline")].train
        assert (nova.mode, nova.steps_policy, nova.algorithm) == ("buffered", "deadline", "fednova")
