"""Feeding an algorithm's halves by hand: updates made up for a server half, a device half trained on an
assignment, and the orchestrator's admission check."""

from __future__ import annotations

from typing import Any

import numpy as np

from edge_client.algorithms.base import ClientAlgorithm
from edge_client.codecs import parse as parse_codec
from edge_client.data import ArrayDataset, BatchSampler
from edge_client.flat import FlatModel
from edge_client.messages import Assignment, Update
from edge_client.trainer import TrainResult, plan_for, train_local
from server.admission import Admission, RoundState
from server.config import TrainSection
from server.strategies import Strategy


def make_update(client_id: str, delta: Any, *, num_samples: int = 10, local_steps: int = 5, **fields: Any) -> Update:
    """A valid round-1 update for feeding server halves by hand; ``fields`` override any other Update field."""
    base: dict[str, Any] = {"round": 1, "model_version": 0, "compute_s": 0.0, "cpu_s": 0.0, "train_loss": 0.0}
    return Update(
        client_id=client_id,
        delta=np.asarray(delta, dtype=np.float32),
        num_samples=num_samples,
        local_steps=local_steps,
        **{**base, **fields},
    )


def train_assignment(
    flat: FlatModel, dataset: ArrayDataset, sampler: BatchSampler, assignment: Assignment, algorithm: ClientAlgorithm
) -> TrainResult:
    """Train on ``assignment`` from its weights as a device does: its plan checked against the contract first."""
    assert assignment.weights is not None, "the assignment needs the weights to start from"
    plan = plan_for(assignment, algorithm, flat.size)
    return train_local(flat, assignment.weights, dataset, sampler, plan, algorithm)


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
