"""FedProx (ALGORITHMS.md 2.2): the analytic prox correction equals SGD on the prox loss by autograd; the server
sends zeta per client and aggregates like FedAvg."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from edge_client.algorithms.contract import ContractError
from edge_client.algorithms.fedavg import FedAvgClient
from edge_client.algorithms.fedprox import FedProxClient
from edge_client.learning.data import ArrayDataset, BatchSampler
from edge_client.wire.messages import Update
from edgefl_testkit.algorithms import flat_of, reference_sgd, set_up, toy_data, toy_model, train_toy
from edgefl_testkit.messages import assignment, make_update
from server.strategies.base import TrainSettings
from server.strategies.fedprox import FedProx

LR, BATCH = 0.2, 4


def dataset() -> ArrayDataset:
    return toy_data(10, seed=7)


def run_client(client, start: np.ndarray, steps: int, params: dict, cid: str = "c0"):
    return train_toy(client, assignment(start, steps, LR, BATCH, settings=params, round=1), dataset(), cid)


def autograd_prox_sgd(start: np.ndarray, steps: int, zeta: float, cid: str = "c0") -> np.ndarray:
    """K SGD steps on CE + zeta/2 ||w - w_t||^2: autograd's CE gradient plus the penalty's zeta (w - w_t)."""
    centre = torch.from_numpy(start.copy())
    data = dataset()
    return reference_sgd(start, data, BatchSampler(len(data), BATCH, 0, cid), steps, LR, lambda w: zeta * (w - centre))


@pytest.mark.parametrize("zeta", [0.1, 1.0, 3.0])
def test_analytic_correction_equals_autograd_of_prox_loss(zeta: float) -> None:
    start = flat_of(toy_model(seed=1))
    result = run_client(FedProxClient(), start, steps=8, params={"zeta": zeta})
    expected_end = autograd_prox_sgd(start, 8, zeta)
    np.testing.assert_allclose(start - result.delta, expected_end, rtol=0, atol=1e-5)
    # and the prox term made a difference (the comparison would not catch a missing correction otherwise)
    plain = run_client(FedAvgClient(), start, steps=8, params={})
    assert np.abs(plain.delta - result.delta).max() > 1e-3


def test_zeta_is_read_every_round_and_zero_is_fedavg() -> None:
    client = FedProxClient()
    start = flat_of(toy_model(seed=2))
    first = run_client(client, start, steps=5, params={"zeta": 2.0})
    np.testing.assert_allclose(start - first.delta, autograd_prox_sgd(start, 5, 2.0), atol=1e-5)
    second = run_client(client, start, steps=5, params={"zeta": 0.0})
    plain = run_client(FedAvgClient(), start, steps=5, params={})
    np.testing.assert_array_equal(second.delta, plain.delta)
    third = run_client(client, start, steps=5, params={"zeta": 0.5})
    np.testing.assert_allclose(start - third.delta, autograd_prox_sgd(start, 5, 0.5), atol=1e-5)


def test_client_keeps_no_state_and_needs_zeta() -> None:
    client = FedProxClient()
    run_client(client, flat_of(toy_model()), steps=2, params={"zeta": 0.1})
    assert client.state_dict() == {}
    assert client._scaled_centre is None  # the round's copy of zeta * w_t is dropped
    with pytest.raises(ContractError, match=r"fedprox.zeta: missing from the assignment"):
        run_client(FedProxClient(), flat_of(toy_model()), steps=2, params={})
    with pytest.raises(ContractError, match=r"fedprox.zeta = -1.0: expected a number >= 0"):
        run_client(FedProxClient(), flat_of(toy_model()), steps=2, params={"zeta": -1.0})


def make_server(params: dict | None = None, cls: type[FedProx] = FedProx) -> FedProx:
    return set_up(cls(TrainSettings(local_steps=5, lr=LR, batch_size=BATCH), params), 3, {"a": 1, "b": 3})


def update(cid: str, samples: int, delta: list[float]) -> Update:
    return make_update(cid, delta, num_samples=samples)


def test_server_sends_zeta_per_client() -> None:
    assert FedProx.contract.setting("zeta").default == 0.1
    assert make_server().assign(1, "a").settings == {"zeta": 0.1}
    assert make_server({"zeta": 0.01}).assign(3, "b").settings == {"zeta": 0.01}
    for bad, words in (
        ({"zeta": -0.1}, "fedprox.zeta = -0.1: expected a number >= 0"),
        ({"zeta": float("nan")}, "fedprox.zeta = nan: expected a number >= 0"),
        ({"mu": 0.1}, "fedprox.mu: not a setting of fedprox"),
    ):
        with pytest.raises(ContractError, match=words):
            make_server(bad)


@pytest.mark.parametrize("weighting", ["uniform", "samples"])
def test_server_aggregates_like_fedavg(weighting: str) -> None:
    w = np.array([1.0, -2.0, 0.5], dtype=np.float32)
    d = [[0.5, 0.0, -1.0], [0.1, 0.3, 0.2]]
    samples = [1, 3]
    p = np.array([0.5, 0.5]) if weighting == "uniform" else np.array(samples) / 4
    expected = w - (p[0] * np.array(d[0]) + p[1] * np.array(d[1]))
    got = make_server({"weighting": weighting}).aggregate(1, w, [update("a", 1, d[0]), update("b", 3, d[1])])
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-6)


def test_server_instructions_drive_the_client() -> None:
    server = make_server({"zeta": 0.7})
    told = server.assign(1, "a")
    start = flat_of(toy_model(seed=3))
    result = run_client(FedProxClient(), start, steps=4, params=told.settings)
    np.testing.assert_allclose(start - result.delta, autograd_prox_sgd(start, 4, 0.7), atol=1e-5)
