"""Messages made by hand, valid unless a test breaks them on purpose: a device's instructions for a round (the one
Assignment builder of the tests) and a device's update."""

from __future__ import annotations

from dataclasses import fields as fields_of
from typing import Any

import numpy as np

from edge_client.wire.messages import Assignment, RoundFacts, Update
from edge_client.wire.plan import Plan

PLAN_FIELDS = {f.name for f in fields_of(Plan)}
FACT_FIELDS = {f.name for f in fields_of(RoundFacts)}


def assignment(
    weights: np.ndarray | None, steps: int = 1, lr: float = 0.1, batch_size: int = 4, **fields: Any
) -> Assignment:
    """A device's instructions for a round with the round's model ``weights`` in place, as the device holds them
    once the model arrived: a plan of ``steps`` local steps and the round's facts. ``fields``: any other field of the
    plan (settings, arrays, momentum, weight_decay) or of the facts (round, algorithm, run_id, sha256...), each put
    in the record that declares it."""
    unknown = set(fields) - PLAN_FIELDS - FACT_FIELDS
    assert not unknown, f"neither a Plan nor a RoundFacts field: {sorted(unknown)}"
    plan = Plan(steps, lr, batch_size, weights=weights, **{k: v for k, v in fields.items() if k in PLAN_FIELDS})
    return Assignment(plan, RoundFacts(**{k: v for k, v in fields.items() if k in FACT_FIELDS}))


def round_assignment(
    round_: int,
    weights: np.ndarray,
    model: dict[str, Any],
    *,
    run_id: str = "",
    deadline_s: float = 30.0,
    **fields: Any,
) -> Assignment:
    """FedAvg's instructions for round ``round_`` of run ``run_id`` on the model ``model`` (a spec), numbered as the
    server numbers them (model version ``round_ - 1``); ``fields``: any other field, these included."""
    facts = {"round": round_, "model_version": round_ - 1, "algorithm": "fedavg", "model": dict(model)}
    return assignment(weights, run_id=run_id, deadline_s=deadline_s, **{**facts, **fields})


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
