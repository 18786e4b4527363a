"""The local SGD loop: exactly tau steps, the descent-positive delta, timings, determinism, the algorithm hooks."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from edge_client.algorithms.base import ClientAlgorithm, LocalContext
from edge_client.algorithms.fedavg import FedAvgClient
from edge_client.learning.data import ArrayDataset, BatchSampler
from edge_client.learning.flat import FlatModel
from edge_client.learning.models import MLP, get_flat, num_params, set_flat
from edge_client.loop.trainer import TrainResult, train_local
from edge_client.wire.plan import Plan


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return MLP(8, 3, hidden=(16,))


def make_dataset(n: int = 64, seed: int = 1) -> ArrayDataset:
    rng = np.random.default_rng(seed)
    return ArrayDataset(rng.normal(size=(n, 8)).astype(np.float32), rng.integers(0, 3, size=n))


def make_plan(local_steps: int = 5, lr: float = 0.1) -> Plan:
    return Plan(local_steps, lr, batch_size=8)


class CountingAlgorithm(ClientAlgorithm):
    """Records every hook call, and what the gradients looked like when correct() ran."""

    def __init__(self) -> None:
        self.begun = 0
        self.steps: list[int] = []
        self.grad_norms: list[float] = []

    def begin_round(self, ctx: LocalContext) -> None:
        self.begun += 1

    def correct(self, ctx: LocalContext, step: int, xb: torch.Tensor, yb: torch.Tensor) -> None:
        self.steps.append(step)
        self.grad_norms.append(float(ctx.flat.grad.abs().sum()))


class ZeroGradients(ClientAlgorithm):
    def correct(self, ctx: LocalContext, step: int, xb: torch.Tensor, yb: torch.Tensor) -> None:
        ctx.flat.grad.zero_()


def run(
    algorithm: ClientAlgorithm,
    local_steps: int = 5,
    client_id: str = "c0",
    seed: int = 0,
    start: np.ndarray | None = None,
) -> tuple[TrainResult, nn.Module, np.ndarray]:
    model = make_model(seed=123)  # a different init: train_local must load the weights it is given
    weights = start if start is not None else get_flat(make_model(seed=0))
    dataset = make_dataset()
    sampler = BatchSampler(len(dataset), 8, seed, client_id)
    result = train_local(FlatModel(model), weights, dataset, sampler, make_plan(local_steps), algorithm)
    return result, model, weights


@pytest.mark.parametrize("local_steps", [1, 7, 20])
def test_runs_exactly_local_steps_steps(local_steps: int) -> None:
    algorithm = CountingAlgorithm()
    result, _, _ = run(algorithm, local_steps=local_steps)
    assert algorithm.begun == 1
    assert algorithm.steps == list(range(local_steps))
    assert result.local_steps == local_steps


def test_correct_runs_after_backward() -> None:
    algorithm = CountingAlgorithm()
    run(algorithm, local_steps=4)
    assert all(norm > 0 for norm in algorithm.grad_norms)  # gradients exist when the hook runs


def test_delta_is_start_minus_end() -> None:
    result, model, start = run(FedAvgClient(), local_steps=5)
    end = get_flat(model)
    assert result.delta.dtype == np.float32
    assert result.delta.shape == (num_params(model),)
    np.testing.assert_allclose(result.delta, start - end, rtol=0, atol=0)
    np.testing.assert_allclose(start - result.delta, end, rtol=0, atol=1e-6)
    assert np.abs(result.delta).max() > 0  # training moved the weights


def test_applying_minus_delta_gives_the_trained_model() -> None:
    result, trained, start = run(FedAvgClient(), local_steps=5)
    rebuilt = make_model(seed=99)
    set_flat(rebuilt, start - result.delta)
    x = torch.from_numpy(make_dataset().x)
    with torch.no_grad():
        torch.testing.assert_close(rebuilt(x), trained(x), rtol=0, atol=1e-5)


def test_delta_is_descent_positive() -> None:
    # One step of plain SGD: delta = lr * grad, so the loss at w - delta is below the loss at w on that batch.
    dataset = make_dataset()
    model = make_model()
    start = get_flat(model)
    sampler = BatchSampler(len(dataset), 8, 0, "c0")
    idx = BatchSampler(len(dataset), 8, 0, "c0").next()  # the batch train_local will draw
    result = train_local(FlatModel(model), start, dataset, sampler, make_plan(local_steps=1, lr=0.05), FedAvgClient())
    probe = make_model()
    set_flat(probe, start)
    xb, yb = torch.from_numpy(dataset.x[idx]), torch.from_numpy(dataset.y[idx])
    loss = nn.functional.cross_entropy(probe(xb), yb)
    loss.backward()
    grad = np.concatenate([p.grad.reshape(-1).numpy() for p in probe.parameters()])
    np.testing.assert_allclose(result.delta, 0.05 * grad, rtol=1e-4, atol=1e-6)


def test_timings_and_loss() -> None:
    result, _, _ = run(FedAvgClient(), local_steps=3)
    assert isinstance(result.compute_s, float) and result.compute_s >= 0
    assert isinstance(result.cpu_s, float) and result.cpu_s >= 0
    assert isinstance(result.train_loss, float) and math.isfinite(result.train_loss)
    assert result.train_loss > 0  # cross-entropy of a random model on random labels


class TickingClock:
    """Stands in for ``time`` in the trainer: seconds advance only when the test says (no timing assertions)."""

    def __init__(self) -> None:
        self.t = 100.0

    def perf_counter(self) -> float:
        return self.t

    def process_time(self) -> float:
        return self.t / 2  # CPU seconds at half the wall clock's pace


class FixedCosts(ClientAlgorithm):
    """2 s before the steps, 0.1 s in each step, 0.5 s after them, on the ticking clock."""

    def __init__(self, clock: TickingClock) -> None:
        self.clock = clock

    def begin_round(self, ctx: LocalContext) -> None:
        self.clock.t += 2.0

    def correct(self, ctx: LocalContext, step: int, xb: torch.Tensor, yb: torch.Tensor) -> None:
        self.clock.t += 0.1

    def end_round(self, ctx: LocalContext, delta: np.ndarray) -> tuple[dict, dict]:
        self.clock.t += 0.5
        return {}, {}


def test_the_per_round_overhead_is_timed_apart_from_the_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = TickingClock()
    monkeypatch.setattr("edge_client.loop.trainer.time", clock)
    result, _, _ = run(FixedCosts(clock), local_steps=10)
    assert result.compute_s == pytest.approx(2.0 + 10 * 0.1 + 0.5)
    assert result.overhead_s == pytest.approx(2.5)  # begin_round + end_round, not the steps
    assert (result.cpu_s, result.overhead_cpu_s) == pytest.approx((1.75, 1.25))


def test_same_seed_and_client_give_the_same_delta() -> None:
    first, _, start = run(FedAvgClient(), local_steps=6, client_id="c1", seed=5)
    second, _, _ = run(FedAvgClient(), local_steps=6, client_id="c1", seed=5, start=start)
    np.testing.assert_array_equal(first.delta, second.delta)
    assert first.train_loss == second.train_loss


def test_other_client_or_seed_draws_other_batches() -> None:
    base, _, start = run(FedAvgClient(), local_steps=6, client_id="c1", seed=5)
    other_client, _, _ = run(FedAvgClient(), local_steps=6, client_id="c2", seed=5, start=start)
    other_seed, _, _ = run(FedAvgClient(), local_steps=6, client_id="c1", seed=6, start=start)
    assert not np.array_equal(base.delta, other_client.delta)
    assert not np.array_equal(base.delta, other_seed.delta)


def test_correct_hook_that_zeroes_gradients_leaves_delta_zero() -> None:
    result, model, start = run(ZeroGradients(), local_steps=5)
    np.testing.assert_array_equal(result.delta, np.zeros_like(start))
    np.testing.assert_array_equal(get_flat(model), start)
    assert math.isfinite(result.train_loss)


def test_starts_from_the_given_weights_not_the_model() -> None:
    # Zero gradients: the model must end exactly at the weights given, whatever it held before.
    model = make_model(seed=7)
    before = get_flat(model)
    start = get_flat(make_model(seed=8))
    assert not np.array_equal(before, start)
    dataset = make_dataset()
    train_local(FlatModel(model), start, dataset, BatchSampler(len(dataset), 8, 0, "c0"), make_plan(2), ZeroGradients())
    np.testing.assert_array_equal(get_flat(model), start)
