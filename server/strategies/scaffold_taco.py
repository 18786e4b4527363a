"""TACO-tailored SCAFFOLD server half (ALGORITHMS.md 2.7 (f)13, TACO Fig. 6; SCAFFOLD 2.4).

SCAFFOLD whose correction coefficient is tailored per client: ``alpha_i^{scaffold} = alpha (1 - alpha_i^t)``, the
correction factor of eq. 8 (SCAFFOLD's ``alpha`` defaults to 1, giving (f)13's ``1 - alpha_i^t``), with ``alpha_i^t``
TACO's eq. 7 coefficient computed by the server from each round's uploads (``taco_alphas``) and used in the client's
next round; ``alpha_i^0 = alpha_init`` (0.1) until a client's first upload. Clients not reporting keep their last
alpha ((f)12). SCAFFOLD's own ``alpha`` is kept as a multiplier (like ``zeta`` in fedprox-taco) rather than silently
ignored. No tailored aggregation, expulsion or z output.
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np

from edge_client.protocol import Update
from server.strategies.base import TrainSettings
from server.strategies.scaffold import Scaffold
from server.strategies.taco import taco_alphas


class ScaffoldTaco(Scaffold):
    """[RECOMMENDED] mapping of (f)13 for SCAFFOLD; the client half is plain SCAFFOLD reading params["alpha"]."""

    name = "scaffold-taco"
    description = "SCAFFOLD with per-client coefficient alpha (1 - alpha_i), alpha_i TACO's eq. 7 coefficient"
    defaults: ClassVar[dict[str, Any]] = {**Scaffold.defaults, "alpha_init": 0.1}

    def __init__(self, settings: TrainSettings, params: dict[str, Any] | None = None, seed: int = 0) -> None:
        super().__init__(settings, params, seed)
        self.taco_alpha: dict[str, float] = {}

    def alpha_of(self, client_id: str) -> float:
        return self.taco_alpha.get(client_id, float(self.params["alpha_init"]))

    def alpha_for(self, client_id: str) -> float:
        return float(self.params["alpha"]) * (1.0 - self.alpha_of(client_id))

    def aggregate(self, round_: int, weights: np.ndarray, updates: list[Update]) -> np.ndarray:
        alphas = taco_alphas([u.delta for u in updates])  # alpha_i^{t+1}, for the next round's coefficient
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
