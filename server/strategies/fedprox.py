"""FedProx server half (ALGORITHMS.md 2.0 line 23 "Others", 2.2 (b)): FedAvg's aggregation, plus ``zeta`` per client.

Every assignment carries ``zeta`` (a device setting); the client adds ``zeta (w - w_t)`` to its gradients. ``zeta``
is TACO's name for the original FedProx ``mu`` (2.2 (f)1; the ``mu`` alias is not accepted).

Streaming: FedAvg's (a running weighted sum and its normaliser, one model-sized vector).
"""

from __future__ import annotations

from edge_client.algorithms.fedprox import CONTRACT
from server.strategies.fedavg import FedAvg


class FedProx(FedAvg):
    """Uniform weights by default (C3); zeta travels to the devices as a device setting of the contract."""

    contract = CONTRACT
