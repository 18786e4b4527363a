"""FedAvg server half (ALGORITHMS.md 2.1).

With ``eta_g = K * eta_l`` the update is ``w_next = w - sum_i p_i delta_i`` over the clients that reported, with
``p_i = 1/|S_t|`` (``weighting = "uniform"``, the default for TACO's experiments) or ``p_i = D_i / D``
(``weighting = "samples"``), renormalised over the updates that arrived.
"""

from __future__ import annotations

import numpy as np

from edge_client.algorithms.fedavg import CONTRACT
from edge_client.protocol import Update
from server.strategies.base import Strategy
from server.strategies.common import aggregation_weights, weighted_sum


class FedAvg(Strategy):
    contract = CONTRACT

    def aggregate(self, round_: int, weights: np.ndarray, updates: list[Update]) -> np.ndarray:
        p = aggregation_weights(updates, self.params["weighting"])
        return weights - weighted_sum(p, (u.delta for u in updates), weights)
