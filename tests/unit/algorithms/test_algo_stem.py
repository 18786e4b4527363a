"""STEM (ALGORITHMS.md 2.5): the client's two-gradient recursion against a manual autograd recomputation, and the
literal server rule on hand-made vectors.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from edge_client.algorithms.contract import ContractError
from edge_client.algorithms.stem import StemClient
from edge_client.learning.data import ArrayDataset, BatchSampler
from edge_client.learning.flat import FlatModel
from edge_client.wire.messages import Assignment, Update
from edge_client.wire.protocol import MissingField
from edgefl_testkit.algorithms import admit, set_up, toy_data, toy_logits, train_assignment
from edgefl_testkit.messages import assignment, make_update
from server.strategies.base import TrainSettings
from server.strategies.stem import Stem

D = 8  # Linear(3, 2)


def make_dataset() -> ArrayDataset:
    return toy_data(16, seed=4)


def stem_assignment(w: np.ndarray, alpha: float, steps: int = 3, lr: float = 0.1, **extra: object) -> Assignment:
    arrays = extra.pop("arrays", {})
    settings = {"alpha": alpha, "init": "grad", **extra}  # the device holds no defaults: the server sends both
    return assignment(w, steps, lr, round=1, algorithm="stem", settings=settings, arrays=arrays)


def grad_at(w: torch.Tensor, xb: np.ndarray, yb: np.ndarray) -> torch.Tensor:
    """Mini-batch gradient of the cross-entropy of Linear(3, 2) with flat parameters w (weight then bias)."""
    p = w.clone().requires_grad_(True)
    loss = F.cross_entropy(toy_logits(p, torch.from_numpy(xb).double()), torch.from_numpy(yb))
    (g,) = torch.autograd.grad(loss, p)
    return g


def manual_stem(
    w0: np.ndarray,
    batches: list[tuple[np.ndarray, np.ndarray]],
    alpha: float,
    lr: float,
    v_bar: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """TACO Alg. 1 line 11: v_k = g(w_k; xi_k) + (1-a)(v_{k-1} - g(w_{k-1}; xi_k)); returns (w_K, v_{K-1})."""
    w = torch.tensor(w0, dtype=torch.float64)
    w_prev, v = None, None
    for k, (xb, yb) in enumerate(batches):
        g = grad_at(w, xb, yb)
        if k == 0:
            if v_bar is None:
                v = g
            else:  # v_{-1} = v_bar, w_{-1} = w_0
                v = g + (1 - alpha) * (torch.tensor(v_bar, dtype=torch.float64) - grad_at(w, xb, yb))
        else:
            v = g + (1 - alpha) * (v - grad_at(w_prev, xb, yb))
        w_prev = w
        w = w - lr * v
    return w.numpy(), v.numpy()


def run_client(
    client: StemClient,
    flat: FlatModel,
    w0: np.ndarray,
    alpha: float,
    steps: int = 3,
    **extra: object,
) -> tuple[np.ndarray, np.ndarray, list[tuple[np.ndarray, np.ndarray]]]:
    data = make_dataset()
    sampler, shadow = BatchSampler(len(data), 4, 0, "c0"), BatchSampler(len(data), 4, 0, "c0")
    result = train_assignment(flat, data, sampler, stem_assignment(w0, alpha, steps, **extra), client)
    batches = []
    for _ in range(steps):
        idx = shadow.next()
        batches.append((data.x[idx], data.y[idx]))
    return result.delta, result.arrays["v"], batches


@pytest.mark.parametrize("alpha", [0.2, 0.5])
def test_client_recursion_matches_manual_autograd_over_three_steps(alpha: float) -> None:
    w0 = np.random.default_rng(0).normal(size=D).astype(np.float32)
    delta, v, batches = run_client(StemClient(), FlatModel(nn.Linear(3, 2)), w0, alpha)
    w_end, v_manual = manual_stem(w0, batches, alpha, 0.1)
    np.testing.assert_allclose(v, v_manual, atol=1e-6)
    np.testing.assert_allclose(delta, w0 - w_end, atol=1e-6)
    # the recursion really differs from the plain last gradient g_{K-1} at w_{K-1} = w_K + lr v_{K-1}
    g_last = grad_at(torch.tensor(w_end + 0.1 * v_manual), *batches[-1]).numpy()
    assert np.abs(v_manual - g_last).max() > 1e-4


def test_second_round_reuses_the_twin_and_stays_exact() -> None:
    client, flat = StemClient(), FlatModel(nn.Linear(3, 2))
    w0 = np.random.default_rng(1).normal(size=D).astype(np.float32)
    run_client(client, flat, w0, 0.2)
    twin = client._twin
    w1 = np.random.default_rng(2).normal(size=D).astype(np.float32)
    delta, v, batches = run_client(client, flat, w1, 0.2)
    assert client._twin is twin  # made once per model
    w_end, v_manual = manual_stem(w1, batches, 0.2, 0.1)  # no state leaks from round 1
    np.testing.assert_allclose(v, v_manual, atol=1e-6)
    np.testing.assert_allclose(delta, w1 - w_end, atol=1e-6)
    run_client(client, FlatModel(nn.Linear(3, 2)), w1, 0.2)
    assert client._twin is not twin  # a different model gets its own twin


def test_server_avg_init_uses_v_bar_at_step_zero() -> None:
    w0 = np.random.default_rng(3).normal(size=D).astype(np.float32)
    v_bar = np.random.default_rng(4).normal(size=D).astype(np.float32)
    delta, v, batches = run_client(
        StemClient(), FlatModel(nn.Linear(3, 2)), w0, 0.3, init="server_avg", arrays={"v_bar": v_bar}
    )
    w_end, v_manual = manual_stem(w0, batches, 0.3, 0.1, v_bar=v_bar)
    np.testing.assert_allclose(v, v_manual, atol=1e-6)
    np.testing.assert_allclose(delta, w0 - w_end, atol=1e-6)
    # without v_bar (round 1) "server_avg" falls back to "grad"
    delta, v, batches = run_client(StemClient(), FlatModel(nn.Linear(3, 2)), w0, 0.3, init="server_avg")
    np.testing.assert_allclose(v, manual_stem(w0, batches, 0.3, 0.1)[1], atol=1e-6)


def test_second_gradient_leaves_the_models_batchnorm_statistics_alone() -> None:
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.ReLU(), nn.Linear(4, 2))
    flat = FlatModel(module)
    data = make_dataset()
    a = stem_assignment(flat.numpy(), 0.2, steps=4)
    train_assignment(flat, data, BatchSampler(len(data), 4, 0, "c0"), a, StemClient())
    assert int(module[1].num_batches_tracked) == 4  # one forward per step on the real model (C6)


# -- server half -------------------------------------------------------------------------------------------------------


def strategy(**params: object) -> Stem:
    return set_up(Stem(TrainSettings(local_steps=5, lr=0.01, batch_size=64), dict(params)), 3)


def update(cid: str, delta: list[float], v: list[float], samples: int = 10) -> Update:
    return make_update(cid, delta, num_samples=samples, arrays={"v": np.array(v, dtype=np.float32)})


W = np.array([1.0, 2.0, -1.0], dtype=np.float32)
UPS = [update("a", [0.1, 0.0, 0.2], [1.0, -1.0, 0.5], 10), update("b", [0.3, -0.2, 0.0], [0.0, 2.0, 1.5], 30)]


def test_server_rule_literal_default() -> None:
    # w_{t+1} = w_t - eta_g/(K N eta_l) sum_i (delta_i + v_i) with eta_g = K eta_l
    deltas, vs = np.array([[0.1, 0.0, 0.2], [0.3, -0.2, 0.0]]), np.array([[1.0, -1.0, 0.5], [0.0, 2.0, 1.5]])
    expected = W - (deltas.sum(axis=0) + vs.sum(axis=0)) / 2
    np.testing.assert_allclose(strategy().aggregate(1, W, UPS), expected, atol=1e-6)
    assert strategy().params["server_v_coeff"] == 1.0 and strategy().params["alpha"] == 0.2


def test_server_rule_with_coefficient_and_sample_weights() -> None:
    p = np.array([10, 30]) / 40
    mean_delta = p[0] * np.array([0.1, 0.0, 0.2]) + p[1] * np.array([0.3, -0.2, 0.0])
    mean_v = p[0] * np.array([1.0, -1.0, 0.5]) + p[1] * np.array([0.0, 2.0, 1.5])
    got = strategy(server_v_coeff=0.05, weighting="samples").aggregate(1, W, UPS)
    np.testing.assert_allclose(got, W - mean_delta - 0.05 * mean_v, atol=1e-6)


def test_assignments_send_alpha_and_server_avg_sends_v_bar_after_a_round() -> None:
    s = strategy(alpha=0.1)
    told = s.assign(1, "a")
    assert told.settings == {"alpha": 0.1, "init": "grad"} and told.arrays == {}
    s.aggregate(1, W, UPS)
    assert s.assign(2, "a").arrays == {}  # "grad": no v_bar travels

    s = strategy(init="server_avg")
    assert s.assign(1, "a").arrays == {}  # (f)5: nothing to send in round 1
    s.aggregate(1, W, UPS)
    np.testing.assert_allclose(s.assign(2, "a").arrays["v_bar"], [0.5, 0.5, 1.0], atol=1e-7)
    fresh = strategy(init="server_avg")
    fresh.load_state_dict(s.state_dict())
    np.testing.assert_allclose(fresh.assign(2, "a").arrays["v_bar"], [0.5, 0.5, 1.0], atol=1e-7)


def test_updates_without_v_are_rejected() -> None:
    s = strategy()
    bad = update("a", [0.0, 0.0, 0.0], [0.0, 0.0, 0.0])
    bad.arrays = {}
    with pytest.raises(MissingField, match=r"stem.v: array missing"):
        admit(s, bad)
    admit(s, UPS[0])


def test_invalid_alpha_is_rejected() -> None:
    with pytest.raises(ContractError, match=r"stem.alpha = 1.5: expected a number in \[0, 1\]"):
        strategy(alpha=1.5)
