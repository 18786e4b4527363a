"""FedAvg server half (ALGORITHMS.md 2.1).

With ``eta_g = K * eta_l`` the update is ``w_next = w - sum_i p_i delta_i`` over the clients that reported, with
``p_i = 1/|S_t|`` (``weighting = "uniform"``, the default for TACO's experiments) or ``p_i = D_i / D``
(``weighting = "samples"``), renormalised over the updates that arrived. The sum is accumulated one update at a time,
so the server never stacks all N updates.
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np

from edge_client.protocol import Update
from server.strategies.base import Strategy


def aggregation_weights(updates: list[Update], weighting: str) -> np.ndarray:
    """``p_i`` over the updates received; falls back to uniform when sample counts sum to zero (ALGORITHMS C5)."""
    if weighting not in ("uniform", "samples"):
        raise ValueError(f"fedavg.weighting must be 'uniform' or 'samples', got {weighting!r}")
    counts = np.array([u.num_samples for u in updates], dtype=np.float64)
    if weighting == "uniform" or counts.sum() <= 0:
        counts = np.ones(len(updates))
    return counts / counts.sum()


class FedAvg(Strategy):
    name = "fedavg"
    defaults: ClassVar[dict[str, Any]] = {"weighting": "uniform"}

    def aggregate(self, round_: int, weights: np.ndarray, updates: list[Update]) -> np.ndarray:
        p = aggregation_weights(updates, self.params["weighting"])
        step = np.zeros_like(weights)
        for p_i, update in zip(p, updates, strict=True):
            step += np.float32(p_i) * update.delta
        return weights - step
