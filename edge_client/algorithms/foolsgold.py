"""FoolsGold client half (ALGORITHMS.md 2.3 (a)): identical to FedAvg; the calibration happens on the server."""

from __future__ import annotations

from edge_client.algorithms.fedavg import FedAvgClient


class FoolsGoldClient(FedAvgClient):
    name = "foolsgold"
