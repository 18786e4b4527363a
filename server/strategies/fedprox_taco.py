"""TACO-tailored FedProx server half (ALGORITHMS.md 2.7 (f)13, TACO Fig. 6; FedProx 2.2).

FedProx (uniform FedAvg aggregation) whose prox coefficient is tailored per client: ``zeta_i^t = zeta (1 - alpha_i^t)``
with ``alpha_i^t`` TACO's eq. 7 coefficient, computed by the server from each round's uploads (``taco_alphas``), sent as
the plan's value ``alpha_i`` and used in the client's next round; ``alpha_i^0 = alpha_init`` (0.1, Algorithm 2's
initialisation) until a client's first upload. Clients not reporting keep their last alpha ((f)12). No tailored
aggregation, expulsion or z output: (f)13 replaces only the coefficient."""

from __future__ import annotations

from edge_client.algorithms.fedprox_taco import CONTRACT
from server.strategies.fedprox import FedProx
from server.strategies.taco import TailoredCoefficients


class FedProxTaco(TailoredCoefficients, FedProx):
    """(f)13 for FedProx: the device turns the alpha_i it is sent into zeta (1 - alpha_i), the paper's correction
    factor scaled by FedProx's own coefficient, not ``zeta := alpha_i`` (docs/algorithms.md, "TACO-tailored FedProx
    and SCAFFOLD", gives the paper's reasons)."""

    contract = CONTRACT
