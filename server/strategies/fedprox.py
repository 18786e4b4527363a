"""FedProx server half (ALGORITHMS.md 2.0 line 23 "Others", 2.2 (b)): FedAvg's aggregation, plus ``zeta`` per client.

The server sends ``{"zeta": zeta_for(client_id)}`` in every assignment; the client adds ``zeta (w - w_t)`` to its
gradients. ``zeta`` is TACO's name for the original FedProx ``mu`` (2.2 (f)1; the ``mu`` alias is not accepted).
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

from server.strategies.base import Instructions, TrainSettings
from server.strategies.fedavg import FedAvg


class FedProx(FedAvg):
    """Uniform weights by default (C3); ``zeta_for`` is the hook for per-client coefficients (TACO-tailored)."""

    name = "fedprox"
    description = "FedAvg with a proximal term zeta/2 ||w - w_t||^2 in each client's local objective"
    defaults: ClassVar[dict[str, Any]] = {"zeta": 0.1, "weighting": "uniform"}

    def __init__(self, settings: TrainSettings, params: dict[str, Any] | None = None, seed: int = 0) -> None:
        super().__init__(settings, params, seed)
        zeta = self.params["zeta"]
        if not math.isfinite(zeta) or zeta < 0:
            raise ValueError(f"{self.name}.zeta must be a finite number >= 0; got {zeta!r}")

    def zeta_for(self, client_id: str) -> float:
        """The prox coefficient this client uses this round."""
        return float(self.params["zeta"])

    def instructions(self, round_: int, client_id: str) -> Instructions:
        instr = super().instructions(round_, client_id)
        instr.params["zeta"] = self.zeta_for(client_id)
        return instr
