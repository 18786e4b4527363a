"""Feeding an algorithm's halves by hand: a server half set up without an orchestrator, a device half trained on
an assignment, the orchestrator's admission check, and the toy task the formulas are checked on: Linear(3, 2) on 3
features and 2 classes, small enough to recompute every step by autograd without the trainer."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import numpy as np
import torch
from torch import nn

from edge_client.algorithms.base import ClientAlgorithm
from edge_client.learning.data import ArrayDataset, BatchSampler
from edge_client.learning.flat import FlatModel
from edge_client.loop.trainer import TrainResult, train_local
from edge_client.wire.codecs import parse as parse_codec
from edge_client.wire.messages import Assignment, Update
from server.admission import Admission, RoundState
from server.config import TrainSection
from server.strategies import Strategy
from server.strategies.base import ServerContext

S = TypeVar("S", bound=Strategy)


def train_assignment(
    flat: FlatModel, dataset: ArrayDataset, sampler: BatchSampler, assignment: Assignment, algorithm: ClientAlgorithm
) -> TrainResult:
    """Train on ``assignment`` from its plan's weights as a device does: its plan checked against the contract first."""
    plan = assignment.plan
    assert plan.weights is not None, "the plan needs the weights to start from"
    algorithm.contract.check_plan(plan, flat.size)
    return train_local(flat, plan.weights, dataset, sampler, plan, algorithm, assignment.facts)


def admit(
    strategy: Strategy,
    update: Update,
    *,
    registered: int | None = None,
    assigned_steps: int | None = None,
    codec: str = "fp32",
) -> float:
    """Judge ``update`` as the orchestrator's admission does in the round it names (its client selected, told
    ``assigned_steps`` and ``codec``, registered with ``registered`` samples; both default to what the update claims);
    raises the ProtocolError that rejects it, or returns the norm of its delta that the orchestrator hands on."""
    cid = update.client_id
    steps = update.local_steps if assigned_steps is None else assigned_steps
    state = RoundState(update.round, update.model_version, {cid}, assigned_steps={cid: steps})
    state.codecs[cid] = parse_codec(codec)
    gate = Admission(strategy.contract, strategy.params, strategy.ctx.num_params, TrainSection.max_update_norm)
    return gate.check(cid, update, state, update.num_samples if registered is None else registered, update.run_id)


def set_up(strategy: S, num_params: int, clients: dict[str, int] | None = None) -> S:
    """``strategy`` set up as the orchestrator does before round 1: a model of ``num_params``, no model spec, the
    registered ``clients`` with their sample counts."""
    strategy.setup(ServerContext(model_spec={}, num_params=num_params, clients=dict(clients or {})))  # its own copy
    return strategy


# ---------------------------------------------------------------------------------------------------- the toy task
def toy_data(n: int, seed: int) -> ArrayDataset:
    """``n`` samples of 3 normal features and a label in {0, 1}."""
    rng = np.random.default_rng(seed)
    return ArrayDataset(rng.normal(size=(n, 3)).astype(np.float32), rng.integers(0, 2, size=n))


def toy_model(seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(3, 2)


def flat_of(module: nn.Module) -> np.ndarray:
    """``module``'s parameters as one float32 vector, in the order FlatModel uses (weight, then bias)."""
    return np.concatenate([p.detach().reshape(-1).numpy() for p in module.parameters()]).astype(np.float32)


def toy_logits(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The toy model's logits from its flat parameters ``w``: what autograd differentiates in a reference."""
    return x @ w[:6].view(2, 3).T + w[6:]


def train_toy(algorithm: ClientAlgorithm, a: Assignment, data: ArrayDataset, cid: str = "c0") -> TrainResult:
    """``algorithm``'s device half trains the toy model on ``a``, drawing batches as device ``cid`` draws them."""
    sampler = BatchSampler(len(data), a.plan.batch_size, 0, cid)
    return train_assignment(FlatModel(toy_model()), data, sampler, a, algorithm)


def reference_sgd(
    start: np.ndarray,
    data: ArrayDataset,
    sampler: BatchSampler,
    steps: int,
    lr: float,
    correction: Callable[[torch.Tensor], torch.Tensor | float] = lambda w: 0.0,
) -> np.ndarray:
    """``steps`` SGD steps of the toy model written without the trainer: autograd's cross-entropy gradient plus
    ``correction(w)`` (what an algorithm adds to every gradient), on ``sampler``'s batches; the end weights."""
    w = torch.from_numpy(np.array(start, dtype=np.float32))
    for _ in range(steps):
        idx = sampler.next()
        v = w.clone().requires_grad_(True)
        loss = nn.functional.cross_entropy(toy_logits(v, torch.from_numpy(data.x[idx])), torch.from_numpy(data.y[idx]))
        (g,) = torch.autograd.grad(loss, [v])
        w = (w - lr * (g + correction(w))).detach()
    return w.numpy()
