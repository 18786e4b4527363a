"""TACO-tailored FedProx client half (ALGORITHMS.md 2.7 (f)13): FedProx's client unchanged.

The server sends each client its own ``zeta_i = zeta (1 - alpha_i)`` as params["zeta"], which FedProx's client
already reads every round; only the algorithm name differs.
"""

from __future__ import annotations

from edge_client.algorithms.fedprox import FedProxClient


class FedProxTacoClient(FedProxClient):
    name = "fedprox-taco"
