"""FedAvg client half (ALGORITHMS.md 2.1): K plain SGD steps from the global model, upload delta = w_0 - w_K."""

from __future__ import annotations

from edge_client.algorithms.base import ClientAlgorithm
from edge_client.contract import Contract, weighting

CONTRACT = Contract(
    "fedavg",
    "K local SGD steps per client; the server averages the updates",
    settings=(weighting("uniform"),),
    dp_refusal="",
    dp_requires=(("weighting", "uniform"),),
)


class FedAvgClient(ClientAlgorithm):
    contract = CONTRACT
