"""FedAvg server half (ALGORITHMS.md 2.1).

With ``eta_g = K * eta_l`` the update is ``w_next = w - sum_i p_i delta_i`` over the clients that reported, with
``p_i = 1/|S_t|`` (``weighting = "uniform"``, the default for TACO's experiments) or ``p_i = D_i / D``
(``weighting = "samples"``), renormalised over the updates that arrived.

Streaming: each delta is folded on arrival into ``sum_i w_i delta_i`` with ``w_i`` = 1 or D_i, and the sum of the
``w_i``; ``finish`` divides once. One model-sized vector, whatever the number of clients.
"""

from __future__ import annotations

import numpy as np

from edge_client.algorithms.fedavg import CONTRACT
from edge_client.wire.messages import Update
from server.strategies.base import Round, Strategy
from server.strategies.common import fold_weight


class FedAvg(Strategy):
    contract = CONTRACT

    def add(self, rnd: Round, update: Update) -> None:
        rnd.add("delta", update.delta, fold_weight(update, self.params["weighting"]))

    def close(self, rnd: Round) -> np.ndarray:
        return rnd.weights - rnd.mean("delta")
