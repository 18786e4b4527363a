"""TACO-tailored FedProx server half (ALGORITHMS.md 2.7 (f)13, TACO Fig. 6; FedProx 2.2).

FedProx (uniform FedAvg aggregation) whose prox coefficient is tailored per client: ``zeta_i^t = zeta (1 - alpha_i^t)``
with ``alpha_i^t`` TACO's eq. 7 coefficient, computed by the server from each round's uploads (``taco_alphas``) and
used in the client's next round; ``alpha_i^0 = alpha_init`` (0.1, Algorithm 2's initialisation) until a client's
first upload. Clients not reporting keep their last alpha ((f)12). No tailored aggregation, expulsion or z output:
(f)13 replaces only the coefficient.
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np

from edge_client.protocol import Update
from server.strategies.base import TrainSettings
from server.strategies.fedprox import FedProx
from server.strategies.taco import taco_alphas


class FedProxTaco(FedProx):
    """[RECOMMENDED] mapping of (f)13 for FedProx; the client half is plain FedProx reading params["zeta"]."""

    name = "fedprox-taco"
    description = "FedProx with per-client zeta_i = zeta (1 - alpha_i), alpha_i TACO's eq. 7 coefficient"
    defaults: ClassVar[dict[str, Any]] = {**FedProx.defaults, "alpha_init": 0.1}

    def __init__(self, settings: TrainSettings, params: dict[str, Any] | None = None, seed: int = 0) -> None:
        super().__init__(settings, params, seed)
        self.taco_alpha: dict[str, float] = {}

    def alpha_of(self, client_id: str) -> float:
        return self.taco_alpha.get(client_id, float(self.params["alpha_init"]))

    def zeta_for(self, client_id: str) -> float:
        return float(self.params["zeta"]) * (1.0 - self.alpha_of(client_id))

    def aggregate(self, round_: int, weights: np.ndarray, updates: list[Update]) -> np.ndarray:
        alphas = taco_alphas([u.delta for u in updates])  # alpha_i^{t+1}, for the next round's zeta_i
        new = super().aggregate(round_, weights, updates)
        self.taco_alpha.update({u.client_id: float(a) for u, a in zip(updates, alphas, strict=True)})
        return new

    def round_metrics(self) -> dict[str, Any]:
        return {**super().round_metrics(), "alpha": dict(self.taco_alpha)}

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "taco_alpha": dict(self.taco_alpha)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.taco_alpha = {str(k): float(v) for k, v in state.get("taco_alpha", {}).items()}
