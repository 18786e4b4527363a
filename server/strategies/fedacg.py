"""FedACG server half (ALGORITHMS.md 2.0 lines 5/19/22, 2.6; [RECOMMENDED] "original" mode after Kim, Kim, Han,
CVPR 2024), in the descent-positive convention with ``m_0 = 0``:

    original:      clients start from the look-ahead w_hat_t = w_t - lambda m_t (the plan's weights),
                   prox centre w_hat_t, delta_i = w_hat_t - w_{i,K}
                   m_next = lambda m_t + sum_i p_i delta_i          p_i = D_i / D (``weighting = "samples"``, line 22)
                   w_next = w_t - m_next  (= w_hat_t - sum_i p_i delta_i)
    taco_literal:  clients start from w_t (line 4), prox centre w_hat_t sent as the array "centre" (2.6 (f)),
                   delta_i = w_t - w_{i,K}
                   w_next = w_t - K' sum_i p_i delta_i - lambda m_t  (line 22 with eta_g = K eta_l: K' = K, the
                                                                     missing K of 2.0; ``include_K`` makes K' = 1)
                   m_next = lambda m_t + sum_i p_i delta_i

``lambda`` is ``server_momentum`` (0.85 [EXTERNAL], not in TACO), ``beta`` the prox coefficient (0.001, TACO).
The strategy returns ``w_next``, which is what the orchestrator evaluates (C8); only the clients see the look-ahead.
Round 1: ``m = 0``, so every client gets the global model itself and (original mode) round 1 is FedProx with
``zeta = beta`` and data-size weights (2.6 (f)).

Streaming: ``sum_i p_i delta_i`` is FedAvg's running weighted sum, divided at the end; ``m`` and the look-ahead are
updated in ``finish``. One model-sized vector per round besides the state, whatever the number of clients.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from edge_client.algorithms.fedacg import CONTRACT
from edge_client.wire.messages import Update
from edge_client.wire.plan import Plan
from server.strategies.base import Round, Strategy, TrainSettings
from server.strategies.common import fold_weight


class FedACG(Strategy):
    """Server state: ``m`` and the look-ahead model (both checkpointed as arrays)."""

    contract = CONTRACT

    def __init__(self, settings: TrainSettings, params: dict[str, Any] | None = None, seed: int = 0) -> None:
        super().__init__(settings, params, seed)
        self.m: np.ndarray | None = None  # None until the first aggregation (m_0 = 0)
        self.lookahead: np.ndarray | None = None  # w_t - lambda m_t, None while it is w_0 itself

    def assign(self, round_: int, client_id: str) -> Plan:
        plan = super().assign(round_, client_id)
        if self.lookahead is not None:
            if self.params["mode"] == "original":
                plan.weights = self.lookahead
            else:
                plan.arrays["centre"] = self.lookahead
        return plan

    def add(self, rnd: Round, update: Update) -> None:
        rnd.add("delta", update.delta, fold_weight(update, self.params["weighting"]))

    def close(self, rnd: Round) -> np.ndarray:
        weights = rnd.weights
        lam = np.float32(self.params["server_momentum"])
        mean = rnd.mean("delta")
        m = np.zeros_like(mean) if self.m is None else self.m
        m_next = lam * m + mean
        if self.params["mode"] == "original":
            new = weights - m_next
        else:
            k = 1 if self.params["include_K"] else self.settings.local_steps
            new = weights - np.float32(k) * mean - lam * m
        self.m = m_next.astype(np.float32)
        self.lookahead = (new - lam * self.m).astype(np.float32)
        return new.astype(np.float32)

    def round_metrics(self) -> dict[str, Any]:
        return {} if self.m is None else {"m_norm": float(np.linalg.norm(self.m))}

    def state_dict(self) -> dict[str, Any]:
        return {
            "m": None if self.m is None else self.m.copy(),
            "lookahead": None if self.lookahead is None else self.lookahead.copy(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        m, la = state.get("m"), state.get("lookahead")
        self.m = None if m is None else np.asarray(m, dtype=np.float32)
        self.lookahead = None if la is None else np.asarray(la, dtype=np.float32)
