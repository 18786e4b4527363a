"""TACO-tailored SCAFFOLD server half (ALGORITHMS.md 2.7 (f)13, TACO Fig. 6; SCAFFOLD 2.4).

SCAFFOLD whose correction coefficient is tailored per client: ``alpha_i^{scaffold} = alpha (1 - alpha_i^t)``, the
correction factor of eq. 8 (SCAFFOLD's ``alpha`` defaults to 1, giving (f)13's ``1 - alpha_i^t``), with ``alpha_i^t``
TACO's eq. 7 coefficient computed by the server from each round's uploads (``taco_alphas``) and used in the client's
next round; ``alpha_i^0 = alpha_init`` (0.1) until a client's first upload. Clients not reporting keep their last
alpha ((f)12). SCAFFOLD's own ``alpha`` is kept as a multiplier (like ``zeta`` in fedprox-taco) rather than silently
ignored. No tailored aggregation, expulsion or z output. SCAFFOLD's ``last_aggregated`` bookkeeping (which keeps
``c`` the mean of the clients' ``c_i`` when updates are lost) is inherited unchanged.
"""

from __future__ import annotations

from edge_client.algorithms.scaffold_taco import CONTRACT
from server.strategies.scaffold import Scaffold
from server.strategies.taco import TailoredCoefficients


class ScaffoldTaco(TailoredCoefficients, Scaffold):
    """(f)13 for SCAFFOLD: the device scales its correction by alpha (1 - alpha_i), the paper's correction factor
    (docs/algorithms.md, "TACO-tailored FedProx and SCAFFOLD", says why not ``alpha := alpha_i``)."""

    contract = CONTRACT
