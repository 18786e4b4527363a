"""Server-side update validation and FedAvg aggregation in-process; its runs over the real broker:
tests/integration/test_orchestrator.py.

The in-process tests drive the orchestrator's ``Dispatch.handle`` with message objects (no connection: constructing an
Orchestrator does not connect) and check the rejection counters and the round's accepted updates (kept without their
vectors: each is folded into the strategy's round on admission). Each invalid update differs from a valid one in
exactly one respect, so each test exercises exactly one check.
"""

from __future__ import annotations

import dataclasses
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from edge_client.algorithms.contract import Array, Value
from edge_client.algorithms.fedavg import CONTRACT as FEDAVG
from edge_client.wire.messages import Assignment, Hello, Presence, RoundFacts, Stop, Update
from edge_client.wire.plan import Plan
from edge_client.wire.topics import Topics
from edge_client.wire.transport import LinkConfig
from edgefl_testkit.orchestrator import initial_weights, small_run_config
from server.admission import Admission, RoundState
from server.evaluation import Evaluator
from server.orchestrator import Orchestrator
from server.strategies import ServerContext, Strategy, TrainSettings, make_strategy
from server.strategies.fedavg import FedAvg


@pytest.fixture
def orch(digits, tmp_path: Path) -> Orchestrator:
    """An unconnected orchestrator in round 2 (model version 1) with c0 and c1 selected, c2 registered but not."""
    job = f"o{uuid.uuid4().hex[:10]}"
    link = LinkConfig("mqtt://127.0.0.1:1", "server", "unused")  # never dialled: it is never connected
    o = Orchestrator(
        small_run_config(tmp_path, job), link, Evaluator(digits.model, digits.test), digits.model, tmp_path
    )
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


def test_update_claiming_more_steps_than_told_is_rejected(orch: Orchestrator) -> None:
    send(orch, "c0", update(orch, "c0", local_steps=3))  # told 2: FedNova/FedVeca would overweight it
    assert orch.link.rejections == {"steps": 1}
    assert received(orch) == {}
