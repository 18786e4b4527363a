"""FedNova (ALGORITHMS.md 2.10): tau_i from D_i, normalised averaging vs an independent numpy recomputation."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from edge_client.algorithms.contract import ContractError
from edge_client.algorithms.fedavg import FedAvgClient
from edge_client.algorithms.fednova import FedNovaClient
from edge_client.learning.data import BatchSampler
from edge_client.learning.flat import FlatModel
from edge_client.learning.models import set_flat
from edge_client.wire.messages import Update
from edgefl_testkit.algorithms import admit, set_up, toy_data, toy_model, train_assignment
from edgefl_testkit.messages import assignment, make_update
from server.admission import WrongSteps
from server.strategies.base import TrainSettings
from server.strategies.fedavg import FedAvg
from server.strategies.fednova import FedNova

SETTINGS = TrainSettings(local_steps=5, lr=0.05, batch_size=10)


def upd(cid: str, delta: np.ndarray, num_samples: int, local_steps: int) -> Update:
    return make_update(cid, delta, num_samples=num_samples, local_steps=local_steps)


def ref_fednova(w: np.ndarray, deltas: list[np.ndarray], d: list[int], tau: list[int], lr: float) -> np.ndarray:
    """Eq. 5 literally: G_i = delta_i/(lr tau_i), p_i = D_i/D, tau_k = sum p tau, d_k = sum p G, w - lr tau_k d_k."""
    p = np.asarray(d, np.float64) / np.sum(d)
    g = [np.asarray(x, np.float32).astype(np.float64) / (lr * t) for x, t in zip(deltas, tau, strict=True)]
    tau_k = float(np.sum(p * np.asarray(tau, np.float64)))
    d_k = np.sum([pi * gi for pi, gi in zip(p, g, strict=True)], axis=0)
    return w.astype(np.float64) - lr * tau_k * d_k


def test_defaults_and_validation() -> None:
    s = FedNova(SETTINGS)
    assert s.name == "fednova"
    assert s.params == {"epochs": 1.0, "local_steps_mode": "epochs"}
    assert FedNova(SETTINGS, {"epochs": 2}).params["epochs"] == 2.0
    with pytest.raises(ContractError, match=r"fednova.epochs = 0.0: expected a number > 0"):
        FedNova(SETTINGS, {"epochs": 0.0})
    with pytest.raises(ContractError, match=r"fednova.local_steps_mode = 'adaptive': expected one of"):
        FedNova(SETTINGS, {"local_steps_mode": "adaptive"})


def test_normalised_update_on_hand_made_vectors() -> None:
    rng = np.random.default_rng(0)
    w = rng.normal(size=8).astype(np.float32)
    d, tau = [10, 30, 60], [1, 3, 6]
    deltas = [rng.normal(size=8) * t for t in tau]
    s = FedNova(SETTINGS)
    out = s.aggregate(1, w, [upd(c, x, n, t) for c, x, n, t in zip("abc", deltas, d, tau, strict=True)])
    np.testing.assert_allclose(out, ref_fednova(w, deltas, d, tau, SETTINGS.lr), rtol=1e-5, atol=1e-6)
    assert out.dtype == np.float32
    tau_k = (10 * 1 + 30 * 3 + 60 * 6) / 100
    assert s.round_metrics() == {"tau": {"a": 1, "b": 3, "c": 6}, "tau_k": pytest.approx(tau_k)}
    # differs from plain sample-weighted FedAvg when the tau_i differ
    fedavg = FedAvg(SETTINGS, {"weighting": "samples"})
    fedavg_out = fedavg.aggregate(1, w, [upd(c, x, n, t) for c, x, n, t in zip("abc", deltas, d, tau, strict=True)])
    assert not np.allclose(out, fedavg_out, atol=1e-3)


def test_partial_participation_renormalises_and_uses_reported_steps() -> None:
    """p_i over the updates received; tau_i = the steps the client actually ran, not what it was assigned."""
    rng = np.random.default_rng(1)
    w = rng.normal(size=5).astype(np.float32)
    s = FedNova(SETTINGS)
    set_up(s, 5, {"a": 40, "b": 100, "c": 20})
    assert s.assign(1, "b").steps == 10
    deltas = [rng.normal(size=5), rng.normal(size=5)]
    updates = [upd("a", deltas[0], 40, 4), upd("b", deltas[1], 100, 7)]  # b stopped after 7 of 10
    out = s.aggregate(1, w, updates)
    np.testing.assert_allclose(out, ref_fednova(w, deltas, [40, 100], [4, 7], SETTINGS.lr), rtol=1e-5, atol=1e-6)
    assert s.round_metrics()["tau"] == {"a": 4, "b": 7}
    assert s.round_metrics()["tau_k"] == pytest.approx((40 * 4 + 100 * 7) / 140)


def test_equal_tau_reduces_to_sample_weighted_fedavg() -> None:
    rng = np.random.default_rng(2)
    w = rng.normal(size=12).astype(np.float32)
    updates = [upd(f"c{i}", rng.normal(size=12), int(n), 4) for i, n in enumerate([5, 17, 80, 33])]
    nova = FedNova(SETTINGS).aggregate(1, w, updates)
    fedavg = FedAvg(SETTINGS, {"weighting": "samples"}).aggregate(1, w, updates)
    np.testing.assert_allclose(nova, fedavg, rtol=1e-6, atol=1e-6)
    # independent: w - sum_i (D_i / D) delta_i
    p = np.array([5, 17, 80, 33], np.float64) / 135
    expected = w - np.sum([pi * u.delta.astype(np.float64) for pi, u in zip(p, updates, strict=True)], axis=0)
    np.testing.assert_allclose(nova, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    ("epochs", "expected"),
    [(1.0, {"a": 10, "b": 3, "c": 1, "d": 1}), (2.5, {"a": 25, "b": 8, "c": 1, "d": 1}), (0.29, {"a": 2, "b": 1})],
)
def test_per_client_tau_from_dataset_size(epochs: float, expected: dict[str, int]) -> None:
    """tau_i = max(1, floor(E D_i / B)) with B = 10: D = 100, 35, 5 (0 steps -> 1), 0."""
    s = FedNova(SETTINGS, {"epochs": epochs})
    set_up(s, 3, {"a": 100, "b": 35, "c": 5, "d": 0})
    for cid, tau in expected.items():
        told = s.assign(1, cid)
        assert told.steps == tau, cid
        assert (told.lr, told.batch_size) == (SETTINGS.lr, SETTINGS.batch_size)


def test_floor_tolerates_float_rounding() -> None:
    """0.29 * 100 / 1 = 28.999999999999996 in floating point; E D_i / B = 29 exactly must give 29 steps."""
    s = FedNova(TrainSettings(local_steps=5, lr=0.1, batch_size=1), {"epochs": 0.29})
    set_up(s, 3, {"a": 100})
    assert s.assign(1, "a").steps == 29


def test_fixed_mode_gives_everyone_the_run_default() -> None:
    s = FedNova(SETTINGS, {"local_steps_mode": "fixed"})
    set_up(s, 3, {"a": 100, "b": 3})
    assert [s.assign(1, c).steps for c in ("a", "b")] == [5, 5]


def test_rejects_update_without_steps() -> None:
    s = FedNova(SETTINGS)
    set_up(s, 3, {"a": 10})
    told = s.assign(1, "a").steps
    admit(s, upd("a", np.zeros(3), 10, 1), assigned_steps=told)
    with pytest.raises(WrongSteps, match="claims 0 local steps"):
        admit(s, upd("a", np.zeros(3), 10, 0), assigned_steps=told)


def test_stateless_round_trip() -> None:
    s = FedNova(SETTINGS)
    assert s.state_dict() == {}
    s.load_state_dict({})


def test_client_delta_over_lr_tau_is_mean_local_gradient() -> None:
    """The client half is FedAvg under the name fednova; for plain SGD delta/(lr tau) = (1/tau) sum of gradients
    (2.10 (a)), recomputed here with autograd on a separate model."""
    assert issubclass(FedNovaClient, FedAvgClient) and FedNovaClient.contract.name == "fednova"
    flat = FlatModel(toy_model())
    w0 = flat.numpy()
    data = toy_data(14, seed=0)
    tau, lr = 6, 0.1
    a = assignment(w0, tau, lr, round=1, algorithm="fednova")
    res = train_assignment(flat, data, BatchSampler(14, 4, 3, "c1"), a, FedNovaClient())
    assert res.local_steps == tau and res.extras == {} and res.arrays == {}

    manual = nn.Linear(3, 2)
    set_flat(manual, w0)
    sampler = BatchSampler(14, 4, 3, "c1")
    grad_sum = np.zeros_like(w0, dtype=np.float64)
    for _ in range(tau):
        idx = sampler.next()
        manual.zero_grad()
        F.cross_entropy(manual(torch.from_numpy(data.x[idx])), torch.from_numpy(data.y[idx])).backward()
        grad_sum += np.concatenate([p.grad.reshape(-1).numpy() for p in manual.parameters()])
        with torch.no_grad():
            for p in manual.parameters():
                p -= lr * p.grad
    np.testing.assert_allclose(res.delta / (lr * tau), grad_sum / tau, atol=1e-5)
