"""Server-side update validation and FedAvg aggregation in-process, then one short run over the real broker.

The in-process tests drive the orchestrator's ``Dispatch.handle`` with message objects (no connection: constructing an
Orchestrator does not connect) and check the rejection counters and the round's accepted updates (kept without their
vectors: each is folded into the strategy's round on admission). Each invalid update differs from a valid one in
exactly one respect, so each test exercises exactly one check.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from edge_client.algorithms.fedavg import CONTRACT as FEDAVG
from edge_client.contract import Array, Value
from edge_client.messages import Assignment, Hello, Presence, RoundFacts, Stop, Update, new_msg_id
from edge_client.models import build_model, get_flat
from edge_client.plan import Plan
from edge_client.protocol import encode
from edge_client.topics import Topics
from edge_client.transport import LinkConfig
from edgefl_testkit.fakes import FakeDevice, zero_update
from server.admission import Admission, RoundState
from server.broker import Broker
from server.config import RunConfig, from_dict
from server.evaluation import Evaluator
from server.orchestrator import Orchestrator
from server.strategies import ServerContext, Strategy, TrainSettings, make_strategy
from server.strategies.fedavg import FedAvg

SEED = 3


def make_config(tmp_path: Path, job: str, *, rounds: int = 3, count: int = 3, **extra: Any) -> RunConfig:
    return from_dict(
        {
            "run": {"rounds": rounds, "out": str(tmp_path / "run"), "job": job, "seed": SEED},
            "clients": {"count": count, "register_timeout_s": 60.0, "round_deadline_s": 60.0},
            "data": {"dataset": "digits"},
            "train": {"local_steps": 2, "batch_size": 8, "lr": 0.1},
            **extra,
        }
    )


def initial_weights(model_spec: dict[str, Any]) -> np.ndarray:
    """What the orchestrator starts from: the model built right after torch.manual_seed(run.seed)."""
    torch.manual_seed(SEED)
    return get_flat(build_model(model_spec))


@pytest.fixture
def orch(broker: Broker, digits, tmp_path: Path) -> Orchestrator:
    """An unconnected orchestrator in round 2 (model version 1) with c0 and c1 selected, c2 registered but not."""
    job = f"o{uuid.uuid4().hex[:10]}"
    link = LinkConfig(broker.url, broker.server.username, broker.server.password)
    o = Orchestrator(make_config(tmp_path, job), link, Evaluator(digits.model, digits.test), digits.model, tmp_path)
    o.num_params = initial_weights(digits.model).size
    use_strategy(o, o.strategy)
    for cid in ("c0", "c1", "c2"):
        o.dispatch.handle(o.topics.up(cid), Hello(client_id=cid, num_samples=100))
    open_round(o, RoundState(round=2, model_version=1, selected={"c0", "c1"}, assigned_steps={"c0": 2, "c1": 2}))
    return o


def open_round(orch: Orchestrator, state: RoundState, weights: np.ndarray | None = None) -> None:
    """Make ``state`` the round in progress and open its aggregation, as ``Orchestrator._train`` does."""
    orch.current = state
    w = np.zeros(orch.num_params, dtype=np.float32) if weights is None else weights
    orch.folding = orch.strategy.begin(state.round, w)


def use_strategy(orch: Orchestrator, strategy: Strategy) -> None:
    """Set up ``strategy`` and the admission of its updates as ``Orchestrator.run`` does before round 1."""
    orch.strategy = strategy
    strategy.setup(ServerContext(orch.model_spec, orch.num_params, orch.client_samples))
    orch.admission = Admission(strategy.contract, strategy.params, orch.num_params, orch.config.train.max_update_norm)
    if orch.current is not None:
        open_round(orch, orch.current)


def received(orch: Orchestrator) -> dict[str, str]:
    """The round's admitted updates: client id -> message id."""
    assert orch.current is not None
    return {cid: u.msg_id for cid, u in orch.current.received.items()}


def update(orch: Orchestrator, cid: str, **changes: Any) -> Update:
    """A valid update from ``cid`` for the orchestrator's current round, with ``changes`` applied."""
    assert orch.current is not None
    fields: dict[str, Any] = {
        "round": orch.current.round,
        "model_version": orch.current.model_version,
        "client_id": cid,
        "num_samples": 100,
        "local_steps": 2,
        "compute_s": 0.1,
        "cpu_s": 0.1,
        "train_loss": 0.5,
        "delta": np.zeros(orch.num_params, dtype=np.float32),
    }
    fields.update(changes)
    return Update(**fields)


def send(orch: Orchestrator, cid: str, msg: Any) -> None:
    orch.dispatch.handle(orch.topics.up(cid), msg)


# ---------------------------------------------------------------------------------------------- update validation
def test_valid_update_is_accepted(orch: Orchestrator) -> None:
    u = update(orch, "c0")
    send(orch, "c0", u)
    assert received(orch) == {"c0": u.msg_id}
    assert not orch.link.rejections
    kept = orch.current.received["c0"]  # the round keeps its scalars, not its vectors: they were folded
    assert kept.delta.size == 0 and kept.arrays == {} and kept.num_samples == u.num_samples
    assert orch.folding is not None and [r.msg_id for r in orch.folding.reports] == [u.msg_id]


@pytest.mark.parametrize("round_", [1, 3], ids=["past_round", "future_round"])
def test_update_for_another_round_is_out_of_round(orch: Orchestrator, round_: int) -> None:
    send(orch, "c0", update(orch, "c0", round=round_))
    assert orch.link.rejections == {"out_of_round": 1}
    assert received(orch) == {}


def test_update_outside_any_round_is_out_of_round(orch: Orchestrator) -> None:
    u = update(orch, "c0")
    orch.current = None
    send(orch, "c0", u)
    assert orch.link.rejections == {"out_of_round": 1}


def test_update_from_client_not_selected_is_out_of_round(orch: Orchestrator) -> None:
    send(orch, "c2", update(orch, "c2"))
    assert orch.link.rejections == {"out_of_round": 1}
    assert received(orch) == {}


def test_second_update_in_a_round_is_a_duplicate(orch: Orchestrator) -> None:
    first = update(orch, "c0")
    send(orch, "c0", first)
    send(orch, "c0", update(orch, "c0", delta=np.ones(orch.num_params, dtype=np.float32)))
    assert orch.link.rejections == {"duplicate": 1}
    assert received(orch) == {"c0": first.msg_id}  # the first one stands


def test_model_version_never_sent_is_rejected_by_its_own_reason(orch: Orchestrator) -> None:
    send(orch, "c0", update(orch, "c0", model_version=0))
    assert orch.link.rejections == {"model_version": 1}
    assert received(orch) == {}


@pytest.mark.parametrize("delta_size", [0, 1, -1], ids=["empty", "one_more", "one_less"])
def test_delta_of_wrong_length_is_a_shape_error(orch: Orchestrator, delta_size: int) -> None:
    n = orch.num_params + delta_size if delta_size else 0
    send(orch, "c0", update(orch, "c0", delta=np.zeros(n, dtype=np.float32)))
    assert orch.link.rejections == {"shape": 1}
    assert received(orch) == {}


def test_update_claiming_another_client_id_is_invalid(orch: Orchestrator) -> None:
    send(orch, "c0", update(orch, "c1"))  # c1's update on c0's topic
    assert orch.link.rejections == {"invalid_field": 1}
    assert received(orch) == {}


@pytest.mark.parametrize("where", ["broadcast", "server", "sideways", "other_job"])
def test_message_on_a_non_client_topic_is_invalid(orch: Orchestrator, where: str) -> None:
    topic = {
        "broadcast": orch.topics.broadcast,
        "server": orch.topics.server,
        "sideways": orch.topics.up("c0")[: -len("up")] + "sideways",
        "other_job": Topics("elsewhere").up("c0"),
    }[where]
    orch.dispatch.handle(topic, update(orch, "c0"))
    assert orch.link.rejections == {"invalid_field": 1}
    assert received(orch) == {}


@pytest.mark.parametrize("kind", ["assignment", "stop"])
def test_server_messages_sent_by_a_client_are_invalid(orch: Orchestrator, kind: str) -> None:
    msg = (
        Stop(reason="bye")
        if kind == "stop"
        else Assignment(
            Plan(1, 0.1, 1, weights=np.zeros(orch.num_params, dtype=np.float32)),
            RoundFacts(round=2, model_version=1, deadline_s=1.0, algorithm="fedavg", model={}),
        )
    )
    send(orch, "c0", msg)
    assert orch.link.rejections == {"invalid_field": 1}


class FedAvgWithBeta(FedAvg):
    """FedAvg whose contract has its clients return a value ``beta`` and an array ``control``."""

    contract = dataclasses.replace(
        FEDAVG,
        name="fedavg-beta",
        returns=(Array("control", "a model-sized vector"),),
        returns_values=(Value("beta", "a finite number >= 0"),),
    )


def test_missing_required_extras_and_arrays_are_rejected(orch: Orchestrator) -> None:
    use_strategy(orch, FedAvgWithBeta(TrainSettings(2, 0.1, 8)))
    control = {"control": np.zeros(orch.num_params, dtype=np.float32)}
    send(orch, "c0", update(orch, "c0", arrays=control))  # no beta
    send(orch, "c0", update(orch, "c0", extras={"beta": 0.5}))  # no control array
    assert orch.link.rejections == {"missing_field": 2}
    assert received(orch) == {}
    send(orch, "c0", update(orch, "c0", extras={"beta": float("nan")}, arrays=control))  # not a finite number
    send(orch, "c0", update(orch, "c0", extras={"beta": 0.5}, arrays={"control": np.zeros(4, np.float32)}))
    assert orch.link.rejections == {"missing_field": 2, "invalid_field": 1, "shape": 1}
    ok = update(orch, "c0", extras={"beta": 0.5}, arrays=control)
    send(orch, "c0", ok)
    assert received(orch) == {"c0": ok.msg_id}


def test_rejections_do_not_block_a_later_valid_update(orch: Orchestrator) -> None:
    send(orch, "c0", update(orch, "c0", round=1))
    send(orch, "c0", update(orch, "c0", delta=np.zeros(5, dtype=np.float32)))
    u = update(orch, "c0")
    send(orch, "c0", u)
    assert orch.link.rejections == {"out_of_round": 1, "shape": 1}
    assert received(orch) == {"c0": u.msg_id}


# ---------------------------------------------------------------------------------------------- registration
def test_hello_registers_and_presence_offline_marks_offline(orch: Orchestrator) -> None:
    send(orch, "c3", Hello(client_id="c3", num_samples=250, device={"hostname": "pi3"}))
    rec = orch.clients["c3"]
    assert (rec.num_samples, rec.device, rec.online) == (250, {"hostname": "pi3"}, True)
    assert "c3" in orch.online()

    send(orch, "c3", Presence(client_id="c3", online=False, reason="connection lost"))
    assert orch.clients["c3"].online is False
    assert "c3" not in orch.online()

    send(orch, "c3", Hello(client_id="c3", num_samples=260))  # back again
    assert orch.clients["c3"].online is True and orch.clients["c3"].num_samples == 260
    assert not orch.link.rejections


def test_hello_claiming_another_client_id_is_rejected(orch: Orchestrator) -> None:
    send(orch, "c4", Hello(client_id="c5", num_samples=1))
    assert orch.link.rejections == {"invalid_field": 1}
    assert "c4" not in orch.clients and "c5" not in orch.clients


# ---------------------------------------------------------------------------------------------- aggregation
def fedavg_expected(w: np.ndarray, deltas: list[np.ndarray], p: list[float]) -> np.ndarray:
    """w_next = w - sum_i p_i delta_i, in float64."""
    acc = w.astype(np.float64).copy()
    for p_i, d in zip(p, deltas, strict=True):
        acc -= p_i * d.astype(np.float64)
    return acc


@pytest.mark.parametrize("weighting", ["uniform", "samples"])
def test_fedavg_aggregates_the_received_updates(orch: Orchestrator, weighting: str) -> None:
    use_strategy(orch, make_strategy("fedavg", TrainSettings(2, 0.1, 8), {"weighting": weighting}))
    rng = np.random.default_rng(0)
    w = rng.standard_normal(orch.num_params).astype(np.float32)
    state = RoundState(
        round=2, model_version=1, selected={"c0", "c1", "c2"}, assigned_steps=dict.fromkeys(("c0", "c1", "c2"), 2)
    )  # c2 never reports
    open_round(orch, state, w)
    samples = {"c0": 30, "c1": 90}
    for cid, n in samples.items():  # data-size weights are what a client registered with
        send(orch, cid, Hello(client_id=cid, num_samples=n))
    deltas = {cid: rng.standard_normal(orch.num_params).astype(np.float32) for cid in samples}
    for cid in samples:
        send(orch, cid, update(orch, cid, num_samples=samples[cid], delta=deltas[cid]))
    assert sorted(orch.current.received) == ["c0", "c1"]
    assert all(u.delta.size == 0 for u in orch.current.received.values())  # folded on arrival, not kept

    assert orch.folding is not None
    got = orch.strategy.finish(orch.folding)

    # renormalised over the two that arrived: uniform 1/2 each (not 1/3), samples 30/120 and 90/120
    p = [0.5, 0.5] if weighting == "uniform" else [0.25, 0.75]
    want = fedavg_expected(w, [deltas["c0"], deltas["c1"]], p)
    assert got.dtype == np.float32 and got.shape == w.shape
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    other = [0.25, 0.75] if weighting == "uniform" else [0.5, 0.5]  # the other weighting is measurably different
    assert not np.allclose(got, fedavg_expected(w, [deltas["c0"], deltas["c1"]], other), rtol=1e-5, atol=1e-5)


def test_fedavg_samples_weighting_falls_back_to_uniform_without_samples() -> None:
    strategy = make_strategy("fedavg", TrainSettings(2, 0.1, 8), {"weighting": "samples"})
    w = np.array([1.0, 2.0, 3.0], dtype=np.float32)
    d0, d1 = np.array([1.0, 0.0, -2.0], dtype=np.float32), np.array([3.0, 4.0, 2.0], dtype=np.float32)
    us = [Update(1, 0, cid, 0, 1, 0.0, 0.0, 0.0, d) for cid, d in (("c0", d0), ("c1", d1))]  # num_samples = 0 for both
    np.testing.assert_allclose(strategy.aggregate(1, w, us), [-1.0, 0.0, 3.0], rtol=1e-6)


def test_fedavg_single_update_applies_its_whole_delta() -> None:
    strategy = make_strategy("fedavg", TrainSettings(2, 0.1, 8))
    w = np.array([0.5, -0.5], dtype=np.float32)
    u = Update(1, 0, "c0", 10, 1, 0.0, 0.0, 0.0, np.array([0.25, -0.25], dtype=np.float32))
    np.testing.assert_array_equal(strategy.aggregate(1, w, [u]), [0.25, -0.25])


# ---------------------------------------------------------------------------------------------- a real run
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
    config = make_config(tmp_path, job, rounds=3, count=1)
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


def test_update_claiming_more_steps_than_told_is_rejected(orch: Orchestrator) -> None:
    send(orch, "c0", update(orch, "c0", local_steps=3))  # told 2: FedNova/FedVeca would overweight it
    assert orch.link.rejections == {"steps": 1}
    assert received(orch) == {}


def test_round_t_is_evaluated_while_round_t_plus_1_trains(broker: Broker, digits, tmp_path: Path) -> None:
    """The evaluation of round t's model waits for round t+1's assignment to reach the device: it can finish only if
    it runs beside that round, not between the rounds. The rows still come one per round, in order, each stamped with
    the time its model was produced (before the next round began) and evaluated on that model."""
    job = f"o{uuid.uuid4().hex[:10]}"
    rounds = 3
    config = make_config(tmp_path, job, rounds=rounds, count=1)
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
