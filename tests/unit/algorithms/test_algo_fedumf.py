"""FedUmf (ALGORITHMS.md 2.9): fusion rule, staleness guard, lr ratio, restart, selection and aggregation.

Expected values are recomputed here from the spec: local training by hand with autograd (SGD, momentum, weight decay)
from the (possibly fused) start point, the server average in plain numpy.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from edge_client.algorithms.contract import ContractError
from edge_client.algorithms.fedumf import FedUmfClient
from edge_client.learning.data import ArrayDataset, BatchSampler
from edge_client.learning.flat import FlatModel
from edge_client.wire.messages import Assignment, RoundFacts, Update
from edgefl_testkit.algorithms import set_up, toy_data, train_assignment
from edgefl_testkit.messages import assignment, make_update
from server.strategies.base import TrainSettings
from server.strategies.fedumf import FedUmf

D = 8  # Linear(3, 2): 6 weights + 2 biases
MOMENTUM, WD = 0.5, 5e-4


def make_dataset() -> ArrayDataset:
    return toy_data(20, seed=3)


def vec(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=D).astype(np.float32)


def manual_train(w0: np.ndarray, batches: list[tuple[np.ndarray, np.ndarray]], lr: float) -> np.ndarray:
    """K steps of SGD with momentum 0.5 and weight decay 5e-4 (buffer reset), gradients by autograd."""
    w = torch.tensor(w0, dtype=torch.float64)
    buf = torch.zeros_like(w)
    for xb, yb in batches:
        p = w.clone().requires_grad_(True)
        loss = F.cross_entropy(torch.from_numpy(xb).double() @ p[:6].reshape(2, 3).T + p[6:], torch.from_numpy(yb))
        (g,) = torch.autograd.grad(loss, p)
        buf = MOMENTUM * buf + (g + WD * w)
        w = w - lr * buf
    return w.numpy()


class Device:
    """One client: a FedUmfClient run through the real trainer, and a twin sampler that predicts its batches."""

    def __init__(self, client: FedUmfClient | None = None, cid: str = "c0") -> None:
        self.data = make_dataset()
        self.flat = FlatModel(nn.Linear(3, 2))
        self.sampler = BatchSampler(len(self.data), 4, 0, cid)
        self.shadow = BatchSampler(len(self.data), 4, 0, cid)
        self.client = client or FedUmfClient()

    def batches(self, steps: int) -> list[tuple[np.ndarray, np.ndarray]]:
        out = []
        for _ in range(steps):
            idx = self.shadow.next()
            out.append((self.data.x[idx], self.data.y[idx]))
        return out

    def round(
        self,
        t: int,
        w: np.ndarray,
        upload: bool,
        *,
        lr: float = 0.1,
        lr_prev: float = 0.1,
        alpha: float = 1.0,
        steps: int = 3,
    ) -> tuple[np.ndarray, list[tuple[np.ndarray, np.ndarray]]]:
        settings = {"alpha": alpha, "lr_prev": lr_prev}
        a = assignment(
            w, steps, lr, round=t, model_version=t - 1, algorithm="fedumf", settings=settings,
            momentum=MOMENTUM, weight_decay=WD, upload=upload,
        )  # fmt: skip
        result = train_assignment(self.flat, self.data, self.sampler, a, self.client)
        return result.delta, self.batches(steps)


def test_round_one_is_a_noop() -> None:
    dev, w1 = Device(), vec(1)
    delta, batches = dev.round(1, w1, upload=True)
    assert dev.client.fused_coefficient == 0.0
    np.testing.assert_allclose(delta, w1 - manual_train(w1, batches, 0.1), atol=1e-6)


def test_fuses_stored_increment_with_alpha_and_lr_ratio() -> None:
    dev, w1, w2 = Device(), vec(1), vec(2)
    delta1, b1 = dev.round(1, w1, upload=False, lr=0.1, lr_prev=0.1)
    g1 = manual_train(w1, b1, 0.1) - w1  # increment of the unfused round = -delta
    np.testing.assert_allclose(dev.client.stored.numpy(), g1, atol=1e-6)
    np.testing.assert_allclose(delta1, -g1, atol=1e-6)

    delta2, b2 = dev.round(2, w2, upload=True, lr=0.05, lr_prev=0.1, alpha=0.5)
    start = w2 + 0.5 * (0.05 / 0.1) * g1  # theta_{t,0} = theta_t + alpha * eta_t / eta_{t-1} * g_{t-1}
    end = manual_train(start, b2, 0.05)
    assert dev.client.fused_coefficient == pytest.approx(0.25)
    np.testing.assert_allclose(delta2, w2 - end, atol=1e-6)  # delta vs the RECEIVED weights includes the fusion
    np.testing.assert_allclose(dev.client.stored.numpy(), end - start, atol=1e-6)  # g_t from the fused start (f)6


@pytest.mark.parametrize(("alpha", "lr", "lr_prev"), [(1.0, 0.1, 0.1), (0.5, 0.1, 0.1), (1.0, 0.0998, 0.1)])
def test_fusion_shift_is_exactly_alpha_times_lr_ratio_times_g(alpha: float, lr: float, lr_prev: float) -> None:
    dev, w1, w2 = Device(), vec(1), vec(2)
    dev.round(1, w1, upload=False)
    g1 = dev.client.stored.numpy().copy()
    assert np.abs(g1).max() > 0
    delta, _ = dev.round(2, w2, upload=True, lr=lr, lr_prev=lr_prev, alpha=alpha, steps=0)  # no local step
    np.testing.assert_allclose(-delta, alpha * (lr / lr_prev) * g1, rtol=0, atol=1e-6)  # float32 w + c g - w


def test_no_fusion_when_selected_in_the_previous_round() -> None:
    dev, w2 = Device(), vec(2)
    dev.round(1, vec(1), upload=True)
    delta, b = dev.round(2, w2, upload=True)
    assert dev.client.fused_coefficient == 0.0
    np.testing.assert_allclose(delta, w2 - manual_train(w2, b, 0.1), atol=1e-6)


def test_no_fusion_when_the_stored_update_is_older_than_one_round() -> None:
    dev, w3 = Device(), vec(3)
    dev.round(1, vec(1), upload=False)  # the client misses round 2 (offline)
    delta, b = dev.round(3, w3, upload=True)
    assert dev.client.fused_coefficient == 0.0
    np.testing.assert_allclose(delta, w3 - manual_train(w3, b, 0.1), atol=1e-6)


def test_unselected_again_trains_plainly_and_overwrites_the_stored_update() -> None:
    dev, w1, w2, w3 = Device(), vec(1), vec(2), vec(3)
    dev.round(1, w1, upload=False)
    delta2, b2 = dev.round(2, w2, upload=False)  # not selected: no fusion, new increment replaces the old one
    assert dev.client.fused_coefficient == 0.0
    end2 = manual_train(w2, b2, 0.1)
    np.testing.assert_allclose(delta2, w2 - end2, atol=1e-6)
    g2 = end2 - w2
    np.testing.assert_allclose(dev.client.stored.numpy(), g2, atol=1e-6)
    assert dev.client.stored_round == 2 and not dev.client.stored_selected

    delta3, b3 = dev.round(3, w3, upload=True)  # fuses g2, not g1
    start = w3 + g2
    np.testing.assert_allclose(delta3, w3 - manual_train(start, b3, 0.1), atol=1e-6)


def test_selected_round_records_selection_so_the_next_selected_round_does_not_fuse() -> None:
    dev = Device()
    dev.round(1, vec(1), upload=False)
    dev.round(2, vec(2), upload=True)  # fused, and now marked as selected in round 2
    assert dev.client.fused_coefficient > 0 and dev.client.stored_selected and dev.client.stored_round == 2
    dev.round(3, vec(3), upload=True)
    assert dev.client.fused_coefficient == 0.0


def test_stored_update_survives_a_client_restart(tmp_path) -> None:  # type: ignore[no-untyped-def]
    assert FedUmfClient().state_dict() == {}  # nothing to save before the first round
    first, w1, w2 = Device(), vec(1), vec(2)
    first.round(1, w1, upload=False)
    g1 = first.client.stored.numpy().copy()
    path = tmp_path / "fedumf.npz"
    np.savez(path, **first.client.state_dict())  # as the runtime saves it

    restarted = FedUmfClient()
    with np.load(path) as saved:
        restarted.load_state_dict({k: saved[k] for k in saved.files})
    dev = Device(client=restarted)
    dev.shadow.next(), dev.shadow.next(), dev.shadow.next()  # keep the batch streams in step
    dev.sampler.next(), dev.sampler.next(), dev.sampler.next()
    delta, b = dev.round(2, w2, upload=True)
    assert restarted.fused_coefficient == 1.0
    np.testing.assert_allclose(delta, w2 - manual_train(w2 + g1, b, 0.1), atol=1e-6)

    empty = FedUmfClient()
    empty.load_state_dict({})
    assert empty.stored is None


# -- server half -------------------------------------------------------------------------------------------------------


def strategy(fraction: float = 0.3, lr: float = 0.1, seed: int = 0, **params: object) -> FedUmf:
    settings = TrainSettings(5, lr, 50, fraction, momentum=MOMENTUM, weight_decay=WD)  # the paper's optimiser
    return set_up(FedUmf(settings, dict(params), seed=seed), 4)


@pytest.mark.parametrize(("n", "fraction"), [(10, 0.3), (10, 0.04), (10, 1.0), (7, 0.5), (100, 0.15)])
def test_selection_size_and_train_only_complement(n: int, fraction: float) -> None:
    s = strategy(fraction)
    available = [f"c{i:03d}" for i in range(n)]
    for t in range(1, 6):
        selected = s.select(t, available)
        rest = s.train_only(t, available, selected)
        assert len(selected) == max(1, round(fraction * n))
        assert len(set(selected)) == len(selected)  # without replacement
        assert set(selected) | set(rest) == set(available) and not set(selected) & set(rest)
        assert s.round_metrics() == {"selected": sorted(selected), "train_only": sorted(rest)}


def test_selection_is_random_over_rounds() -> None:
    s, available = strategy(0.2), [f"c{i}" for i in range(10)]
    picks = [tuple(s.select(t, available)) for t in range(1, 41)]
    assert len(set(picks)) > 1
    assert set().union(*picks) == set(available)


def test_assignments_carry_fusion_and_optimiser_parameters_with_the_lr_schedule() -> None:
    s = strategy(lr=0.1, alpha=0.5, lr_decay=0.9)
    one, three = s.assign(1, "c0"), s.assign(3, "c0")
    assert one.lr == pytest.approx(0.1) and one.settings["lr_prev"] == pytest.approx(0.1)
    assert three.lr == pytest.approx(0.1 * 0.9**2) and three.settings["lr_prev"] == pytest.approx(0.09)
    assert three.settings == {"alpha": 0.5, "lr_prev": pytest.approx(0.09)}
    assert three.momentum == 0.5 and three.weight_decay == 5e-4  # the run's optimiser (train.momentum/weight_decay)
    assert three.steps == 5  # local_unit "steps": the run's local_steps


def test_epochs_unit_gives_ceil_samples_over_batch_times_epochs() -> None:
    s = strategy(local_unit="epochs", epochs=2)
    s.ctx.clients.update({"a": 130, "b": 100})
    assert s.assign(1, "a").steps == math.ceil(130 / 50) * 2
    assert s.assign(1, "b").steps == 2 * 2
    assert s.assign(1, "unknown").steps == 5


def update(cid: str, delta: np.ndarray, samples: int) -> Update:
    return make_update(cid, delta, num_samples=samples)


@pytest.mark.parametrize("weighting", ["samples", "uniform"])
def test_aggregation_is_the_weighted_mean_of_uploaded_models(weighting: str) -> None:
    w = np.array([1.0, -2.0, 0.5, 3.0], dtype=np.float32)
    deltas = [np.array([0.1, 0.2, -0.3, 0.0]), np.array([-1.0, 0.5, 0.5, 2.0]), np.array([0.0, 0.0, 1.0, -1.0])]
    samples = [10, 30, 60]
    ups = [update(f"c{i}", d, m) for i, (d, m) in enumerate(zip(deltas, samples, strict=True))]
    models = [w.astype(np.float64) - d for d in deltas]  # theta_{t+1}^i
    p = np.array(samples) / sum(samples) if weighting == "samples" else np.full(3, 1 / 3)
    expected = sum(pi * m for pi, m in zip(p, models, strict=True))
    got = strategy(weighting=weighting).aggregate(1, w, ups)
    np.testing.assert_allclose(got, expected, atol=1e-6)


def test_default_weighting_is_samples() -> None:
    defaults = strategy().params
    assert defaults["weighting"] == "samples" and defaults["local_unit"] == "steps"
    assert defaults["alpha"] == 1.0 and defaults["lr_decay"] == 1.0


def test_state_round_trip_through_json() -> None:
    s = strategy(0.5)
    avail = ["a", "b", "c", "d"]
    s.train_only(1, avail, s.select(1, avail))
    fresh = strategy(0.5)
    fresh.load_state_dict(s.state_dict())
    assert fresh.round_metrics() == s.round_metrics()


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ({"alpha": 1.5}, r"fedumf.alpha = 1.5: expected a number in \[0, 1\]"),
        ({"lr_decay": 0.0}, r"fedumf.lr_decay = 0.0: expected a number > 0"),
        ({"momentum": 0.5}, "fedumf.momentum: not a setting of fedumf"),  # the run's train.momentum now
        ({"local_unit": "batches"}, "fedumf.local_unit = 'batches': expected one of 'steps', 'epochs'"),
    ],
)
def test_invalid_parameters_are_rejected(bad: dict[str, object], message: str) -> None:
    with pytest.raises(ContractError, match=message):
        strategy(**bad)


def test_in_process_rounds_fuse_exactly_the_newly_selected_clients() -> None:
    """Server and clients wired as the orchestrator does: the client fuses iff in S_t and not in S_{t-1}."""
    s = strategy(0.4, lr=0.1, lr_decay=0.9, seed=5)
    set_up(s, D, {f"c{i}": 20 for i in range(5)})
    devices = {f"c{i}": Device(cid=f"c{i}") for i in range(5)}
    w, previous = vec(0), set()
    for t in range(1, 7):
        available = sorted(devices)
        selected = s.select(t, available)
        updates = []
        for cid in [*selected, *s.train_only(t, available, selected)]:
            told = s.assign(t, cid)  # sent with the round's facts as the orchestrator does
            told.weights = w
            a = Assignment(told, RoundFacts(round=t, model_version=t - 1, algorithm="fedumf", upload=cid in selected))
            dev = devices[cid]
            result = train_assignment(dev.flat, dev.data, dev.sampler, a, dev.client)
            should_fuse = cid in selected and cid not in previous and t > 1
            assert (dev.client.fused_coefficient > 0) == should_fuse, (t, cid)
            if should_fuse:
                assert dev.client.fused_coefficient == pytest.approx(0.9)  # alpha 1 * eta_t / eta_{t-1}
            if cid in selected:
                updates.append(update(cid, result.delta, 20))
        w = s.aggregate(t, w, updates)
        previous = set(selected)
