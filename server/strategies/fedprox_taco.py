"""TACO-tailored FedProx server half (ALGORITHMS.md 2.7 (f)13, TACO Fig. 6; FedProx 2.2).

FedProx (uniform FedAvg aggregation) whose prox coefficient is tailored per client: ``zeta_i^t = zeta (1 - alpha_i^t)``
with ``alpha_i^t`` TACO's eq. 7 coefficient, computed by the server from each round's uploads (``taco_alphas``) and
used in the client's next round; ``alpha_i^0 = alpha_init`` (0.1, Algorithm 2's initialisation) until a client's
first upload. Clients not reporting keep their last alpha ((f)12). No tailored aggregation, expulsion or z output:
(f)13 replaces only the coefficient.
"""

from __future__ import annotations

from typing import Any, ClassVar

from server.strategies.fedprox import FedProx
from server.strategies.taco import TailoredCoefficients


class FedProxTaco(TailoredCoefficients, FedProx):
    """[RECOMMENDED] mapping of (f)13 for FedProx; the client half is plain FedProx reading params["zeta"]."""

    name = "fedprox-taco"
    description = "FedProx with per-client zeta_i = zeta (1 - alpha_i), alpha_i TACO's eq. 7 coefficient"
    defaults: ClassVar[dict[str, Any]] = {**FedProx.defaults, **TailoredCoefficients.tailored_defaults}
    choices: ClassVar[dict[str, tuple[Any, ...]]] = {**FedProx.choices, **TailoredCoefficients.tailored_choices}

    def zeta_for(self, client_id: str) -> float:
        return float(self.params["zeta"]) * (1.0 - self.alpha_of(client_id))
