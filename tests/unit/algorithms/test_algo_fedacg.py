"""FedACG (ALGORITHMS.md 2.6): server momentum and look-ahead over several rounds against an independent numpy
recomputation, the client's prox step around the received look-ahead, the taco_literal mode, state round trips."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from edge_client.algorithms.contract import ContractError
from edge_client.algorithms.fedacg import FedACGClient
from edge_client.algorithms.fedprox import FedProxClient
from edge_client.learning.data import ArrayDataset, BatchSampler
from edge_client.wire.messages import Update
from edgefl_testkit.algorithms import flat_of, reference_sgd, set_up, toy_data, toy_model, train_toy
from edgefl_testkit.messages import assignment, make_update
from server.strategies.base import TrainSettings
from server.strategies.fedacg import FedACG

LR, BATCH, K, D = 0.2, 4, 5, 8


def dataset() -> ArrayDataset:
    return toy_data(10, seed=11)


def run_client(client, weights: np.ndarray, steps: int, params: dict, arrays: dict | None = None):
    return train_toy(client, assignment(weights, steps, LR, BATCH, settings=params, arrays=arrays or {}), dataset())


def autograd_prox_sgd(start: np.ndarray, centre: np.ndarray, steps: int, beta: float) -> np.ndarray:
    """SGD from ``start`` on CE + beta/2 ||w - centre||^2: autograd's CE gradient plus the prox term's beta (w - c)."""
    c = torch.from_numpy(centre.copy())
    data = dataset()
    return reference_sgd(start, data, BatchSampler(len(data), BATCH, 0, "c0"), steps, LR, lambda w: beta * (w - c))


def make_server(params: dict | None = None, clients: dict | None = None) -> FedACG:
    return set_up(FedACG(TrainSettings(local_steps=K, lr=LR, batch_size=BATCH), params), D, clients or {"a": 1, "b": 3})


def update(cid: str, samples: int, delta: np.ndarray) -> Update:
    return make_update(cid, delta, num_samples=samples, local_steps=K)


def test_defaults() -> None:
    defaults = make_server().params
    assert defaults["beta"] == 0.001
    assert defaults["server_momentum"] == 0.85
    assert defaults["weighting"] == "samples"
    assert defaults["mode"] == "original"
    for bad in ({"server_momentum": 1.0}, {"server_momentum": -0.1}, {"beta": -1.0}, {"mode": "other"}):
        (key, value), *_ = bad.items()
        with pytest.raises(ContractError, match=f"fedacg.{key} = {value!r}: expected"):
            make_server(bad)


def test_original_mode_momentum_and_lookahead_over_three_rounds() -> None:
    rng = np.random.default_rng(0)
    lam, samples = 0.85, {"a": 1, "b": 3}
    server = make_server({"beta": 0.01})
    w = rng.normal(size=D).astype(np.float32)
    # independent recomputation (2.6 (a)/(b)): m_0 = 0, w_hat_t = w_t - lam m_t, m_{t+1} = lam m_t + sum p_i delta_i,
    # w_{t+1} = w_t - m_{t+1}
    ref_w, ref_m = w.astype(np.float64), np.zeros(D)
    for round_ in (1, 2, 3):
        lookahead = ref_w - lam * ref_m
        told = server.assign(round_, "a")
        assert told.settings == {"beta": 0.01}
        assert not told.arrays
        if round_ == 1:
            assert told.weights is None  # m_0 = 0: the look-ahead is w_0, the global model itself
        else:
            np.testing.assert_allclose(told.weights, lookahead, rtol=0, atol=1e-5)
        deltas = {k: rng.normal(size=D) for k in samples}
        mean = (samples["a"] * deltas["a"] + samples["b"] * deltas["b"]) / 4
        ref_m = lam * ref_m + mean
        ref_w = ref_w - ref_m
        np.testing.assert_allclose(ref_w, lookahead - mean, atol=1e-12)  # = w_hat_t - sum p_i delta_i
        w = server.aggregate(round_, w, [update(k, samples[k], deltas[k]) for k in samples])
        assert w.dtype == np.float32
        np.testing.assert_allclose(w, ref_w, rtol=0, atol=1e-5)  # evaluated model = w_{t+1}, not the look-ahead
        np.testing.assert_allclose(server.m, ref_m, rtol=0, atol=1e-5)
        np.testing.assert_allclose(server.round_metrics()["m_norm"], np.linalg.norm(ref_m), rtol=1e-5)
    assert np.abs(ref_m).max() > 0.1


def test_uniform_weighting_option() -> None:
    server = make_server({"weighting": "uniform"})
    w = np.zeros(D, dtype=np.float32)
    new = server.aggregate(1, w, [update("a", 1, np.ones(D)), update("b", 3, 3 * np.ones(D))])
    np.testing.assert_allclose(new, -2 * np.ones(D), atol=1e-6)


@pytest.mark.parametrize("include_k", [False, True])
def test_taco_literal_mode(include_k: bool) -> None:
    rng = np.random.default_rng(1)
    lam = 0.5
    server = make_server({"mode": "taco_literal", "server_momentum": lam, "include_K": include_k})
    w = rng.normal(size=D).astype(np.float32)
    ref_w, ref_m = w.astype(np.float64), np.zeros(D)
    factor = 1 if include_k else K  # line 22 without its 1/K, with eta_g = K eta_l
    for round_ in (1, 2, 3):
        told = server.assign(round_, "b")
        assert told.weights is None  # clients start from w_t (line 4)
        if round_ == 1:
            assert not told.arrays
        else:
            np.testing.assert_allclose(told.arrays["centre"], ref_w - lam * ref_m, atol=1e-5)
        deltas = {k: rng.normal(size=D) for k in ("a", "b")}
        mean = (deltas["a"] + 3 * deltas["b"]) / 4
        ref_w = ref_w - factor * mean - lam * ref_m
        ref_m = lam * ref_m + mean
        w = server.aggregate(round_, w, [update("a", 1, deltas["a"]), update("b", 3, deltas["b"])])
        np.testing.assert_allclose(w, ref_w, rtol=0, atol=1e-5)


@pytest.mark.parametrize("beta", [0.001, 0.5])
def test_client_prox_around_the_received_lookahead(beta: float) -> None:
    lookahead = flat_of(toy_model(seed=2))
    result = run_client(FedACGClient(), lookahead, 6, {"beta": beta})
    np.testing.assert_allclose(lookahead - result.delta, autograd_prox_sgd(lookahead, lookahead, 6, beta), atol=1e-5)
    assert FedACGClient().state_dict() == {}


def test_client_with_an_explicit_centre() -> None:
    start, centre = flat_of(toy_model(seed=2)), flat_of(toy_model(seed=3))
    result = run_client(FedACGClient(), start, 6, {"beta": 0.8}, {"centre": centre})
    np.testing.assert_allclose(start - result.delta, autograd_prox_sgd(start, centre, 6, 0.8), atol=1e-5)
    # a prox around the start would give another model: the centre was really used
    assert np.abs(autograd_prox_sgd(start, start, 6, 0.8) - (start - result.delta)).max() > 1e-3
    with pytest.raises(ContractError, match=r"fedacg.beta: missing from the assignment"):
        run_client(FedACGClient(), start, 2, {})


def test_round_one_is_fedprox_with_zeta_beta() -> None:
    start = flat_of(toy_model(seed=4))
    server = make_server({"beta": 0.3})
    told = server.assign(1, "a")
    acg = run_client(FedACGClient(), start if told.weights is None else told.weights, K, told.settings)
    prox = run_client(FedProxClient(), start, K, {"zeta": 0.3})
    np.testing.assert_array_equal(acg.delta, prox.delta)


def test_end_to_end_two_rounds_clients_start_from_the_lookahead() -> None:
    server = make_server({"beta": 0.1})
    w = flat_of(toy_model(seed=5))
    ref_w, ref_m = w.astype(np.float64), np.zeros(D)
    for round_ in (1, 2):
        told = server.assign(round_, "a")
        sent = w if told.weights is None else told.weights
        np.testing.assert_allclose(sent, ref_w - 0.85 * ref_m, atol=1e-5)
        r = run_client(FedACGClient(), sent, K, told.settings)
        np.testing.assert_allclose(sent - r.delta, autograd_prox_sgd(sent, sent, K, 0.1), atol=1e-5)
        ref_m = 0.85 * ref_m + r.delta
        ref_w = ref_w - ref_m
        w = server.aggregate(round_, w, [update("a", 1, r.delta)])
        np.testing.assert_allclose(w, ref_w, atol=1e-5)


def test_state_round_trip() -> None:
    server = make_server()
    assert server.state_dict() == {"m": None, "lookahead": None}
    rng = np.random.default_rng(2)
    w = rng.normal(size=D).astype(np.float32)
    w = server.aggregate(1, w, [update("a", 1, rng.normal(size=D))])
    other = make_server()
    other.load_state_dict(server.state_dict())
    np.testing.assert_array_equal(other.assign(2, "a").weights, server.assign(2, "a").weights)
    d = rng.normal(size=D)
    np.testing.assert_array_equal(
        other.aggregate(2, w, [update("a", 1, d)]), server.aggregate(2, w, [update("a", 1, d)])
    )
