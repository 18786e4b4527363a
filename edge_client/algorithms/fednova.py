"""FedNova client half (ALGORITHMS.md 2.10 (a)): FedAvg's plain SGD for the ``tau_i`` steps the server assigns.

With plain SGD, ``G_i = (1/tau_i) sum_lambda g_lambda = delta_i / (eta tau_i)`` exactly, so the client uploads only
``delta`` (the wire's descent-positive difference) and the server normalises it with the steps the update reports
(``Update.local_steps``); ``D_i`` travels as ``Update.num_samples``. Nothing is kept across rounds.
"""

from __future__ import annotations

from edge_client.algorithms.fedavg import FedAvgClient


class FedNovaClient(FedAvgClient):
    name = "fednova"
