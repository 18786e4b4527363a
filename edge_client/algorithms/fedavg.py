"""FedAvg client half (ALGORITHMS.md 2.1): K plain SGD steps from the global model, upload delta = w_0 - w_K."""

from __future__ import annotations

from edge_client.algorithms.base import ClientAlgorithm


class FedAvgClient(ClientAlgorithm):
    name = "fedavg"
