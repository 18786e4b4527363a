"""FoolsGold, TACO's variant (ALGORITHMS.md 2.3 [RECOMMENDED] executable form): cosine-to-mean weights clipped at 0,
the uniform fallback, the options, and the client half that is FedAvg's."""

from __future__ import annotations

import numpy as np
import pytest

from edge_client.algorithms.contract import ContractError
from edge_client.algorithms.fedavg import FedAvgClient
from edge_client.algorithms.foolsgold import FoolsGoldClient
from edge_client.wire.messages import Update
from edgefl_testkit.algorithms import flat_of, set_up, toy_data, toy_model, train_toy
from edgefl_testkit.messages import assignment, make_update
from server.strategies.base import TrainSettings
from server.strategies.foolsgold import FoolsGold

D = 4


def make_server(params: dict | None = None) -> FoolsGold:
    return set_up(FoolsGold(TrainSettings(local_steps=5, lr=0.1, batch_size=8), params), D, {"a": 1, "b": 1, "c": 1})


def updates(deltas: list) -> list[Update]:
    return [make_update(f"c{i}", d) for i, d in enumerate(deltas)]


def cos(a: np.ndarray, b: np.ndarray) -> float:
    na, nb = np.linalg.norm(a), np.linalg.norm(b)
    return 0.0 if na < 1e-12 or nb < 1e-12 else float(a @ b / (na * nb))


def spec_rule(w: np.ndarray, deltas: list, clip: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """2.3 [RECOMMENDED], written from the spec: r = mean, rho = max(0, cos), uniform if sum rho <= eps."""
    ds = [np.asarray(d, dtype=np.float64) for d in deltas]
    r = sum(ds) / len(ds)
    rho = np.array([cos(d, r) for d in ds])
    if clip:
        rho = np.maximum(rho, 0)
    if rho.sum() <= 1e-12:
        rho = np.ones(len(ds))
    return w - sum(p * d for p, d in zip(rho, ds, strict=True)) / rho.sum(), rho


W = np.array([0.5, -1.0, 2.0, 0.0], dtype=np.float32)
HONEST = [[1.0, 0.5, 0.0, -0.2], [0.8, 0.7, 0.1, 0.0], [1.2, 0.2, -0.1, -0.3]]


def test_defaults() -> None:
    assert make_server().params == {
        "clip_negative": True,
        "reference": "current_mean",
        "extra_1_over_N": False,
        "fixed_point_iters": 1,
    }
    for bad in ({"reference": "median"}, {"fixed_point_iters": 0}, {"clip_negative": 1}):
        (key, value), *_ = bad.items()
        with pytest.raises(ContractError, match=f"foolsgold.{key} = {value!r}: expected"):
            make_server(bad)


def test_weights_follow_the_cosine_to_the_mean() -> None:
    expected, rho = spec_rule(W, HONEST)
    assert len(set(np.round(rho, 6))) == 3  # distinct weights: not FedAvg in disguise
    server = make_server()
    np.testing.assert_allclose(server.aggregate(1, W, updates(HONEST)), expected, rtol=0, atol=1e-6)
    got_rho = server.round_metrics()["rho"]
    np.testing.assert_allclose([got_rho[f"c{i}"] for i in range(3)], rho, atol=1e-6)
    assert server.round_metrics()["uniform_fallback"] is False


def test_a_reversed_update_is_clipped_to_zero() -> None:
    reversed_ = (-np.mean(HONEST, axis=0)).tolist()  # an honest-sized update, pointing backwards
    deltas = [*HONEST, reversed_]
    expected, rho = spec_rule(W, deltas)
    server = make_server()
    got = server.aggregate(1, W, updates(deltas))
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-6)
    metrics = server.round_metrics()["rho"]
    assert metrics["c3"] == 0.0
    assert all(metrics[f"c{i}"] > 0 for i in range(3))
    # the reversed update carries no weight: same step as the honest ones with their own rho
    honest_rho = rho[:3]
    honest_only = W - sum(p * np.array(d) for p, d in zip(honest_rho, HONEST, strict=True)) / honest_rho.sum()
    np.testing.assert_allclose(got, honest_only, atol=1e-6)
    # without clipping the reversed update gets a negative weight (the literal, unclipped rule)
    unclipped, rho_u = spec_rule(W, deltas, clip=False)
    assert rho_u[3] < 0
    np.testing.assert_allclose(
        make_server({"clip_negative": False}).aggregate(1, W, updates(deltas)), unclipped, atol=1e-6
    )


def test_all_non_positive_falls_back_to_uniform() -> None:
    # current mean: updates cancel, the reference is 0, every cosine is 0 (C5 guard) -> uniform weights
    deltas = [[1.0, 0.0, 0.0, 0.0], [-1.0, 2.0, 0.0, 0.0], [0.0, -2.0, 0.0, 0.0]]
    server = make_server()
    np.testing.assert_allclose(server.aggregate(1, W, updates(deltas)), W - np.mean(deltas, axis=0), atol=1e-6)
    assert server.round_metrics()["uniform_fallback"] is True
    assert set(server.round_metrics()["rho"].values()) == {0.0}

    # previous-global reference: every update of round 2 points against w_1 - w_2 -> all rho clipped to 0 -> uniform
    server = make_server({"reference": "prev_global"})
    first = [[1.0, 1.0, 0.0, 0.0], [3.0, 1.0, 0.0, 0.0]]
    w1 = server.aggregate(1, W, updates(first))
    np.testing.assert_allclose(w1, W - np.mean(first, axis=0), atol=1e-6)  # round 1: no reference -> uniform
    second = [[-1.0, -0.5, 0.0, 0.0], [-2.0, 0.0, 1.0, 0.0], [-0.5, -2.0, 0.0, 3.0]]
    w2 = server.aggregate(2, w1, updates(second))
    assert server.round_metrics()["uniform_fallback"] is True
    np.testing.assert_allclose(w2, w1 - np.mean(second, axis=0), atol=1e-6)


def test_prev_global_reference_weights() -> None:
    server = make_server({"reference": "prev_global"})
    w1 = server.aggregate(1, W, updates([[1.0, 0.0, 0.0, 0.0]]))
    ref = W - w1  # the previous global update
    deltas = [[1.0, 1.0, 0.0, 0.0], [0.0, 1.0, 0.0, 0.0], [2.0, 0.0, 0.0, 1.0]]
    rho = np.array([max(0.0, cos(np.array(d), ref)) for d in deltas])
    expected = w1 - sum(p * np.array(d) for p, d in zip(rho, deltas, strict=True)) / rho.sum()
    np.testing.assert_allclose(server.aggregate(2, w1, updates(deltas)), expected, atol=1e-6)
    state = server.state_dict()
    other = make_server({"reference": "prev_global"})
    other.load_state_dict(state)
    np.testing.assert_allclose(other.prev_global, server.prev_global)
    assert make_server().state_dict() == {"prev_global": None}


def test_fixed_point_iterations() -> None:
    deltas = [*HONEST, [0.0, 1.0, 0.0, 0.0]]
    ds = [np.array(d) for d in deltas]
    r = sum(ds) / 4
    for _ in range(3):  # three evaluations of rho, each against the previous weighted aggregate
        rho = np.array([max(0.0, cos(d, r)) for d in ds])
        r = sum(p * d for p, d in zip(rho, ds, strict=True)) / rho.sum()
    expected = W - r
    got = make_server({"fixed_point_iters": 3}).aggregate(1, W, updates(deltas))
    np.testing.assert_allclose(got, expected, atol=1e-6)
    assert np.abs(got - spec_rule(W, deltas)[0]).max() > 1e-4  # iterating changed the weights


def test_literal_extra_one_over_n() -> None:
    expected, _ = spec_rule(W, HONEST)
    got = make_server({"extra_1_over_N": True}).aggregate(1, W, updates(HONEST))
    np.testing.assert_allclose(got, W - (W - expected) / 3, atol=1e-6)


def test_client_is_fedavg() -> None:
    assert FoolsGoldClient.contract.name == "foolsgold"
    assert issubclass(FoolsGoldClient, FedAvgClient)
    start = flat_of(toy_model())
    data = toy_data(10, seed=0)
    results = []
    for client in (FoolsGoldClient(), FedAvgClient()):
        results.append(train_toy(client, assignment(start, 4, 0.1, round=1, algorithm=client.name), data))
        assert client.state_dict() == {}
    np.testing.assert_array_equal(results[0].delta, results[1].delta)
    assert results[0].arrays == {} and results[0].extras == {}
