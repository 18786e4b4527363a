"""FedAvg client half (ALGORITHMS.md 2.1): K plain SGD steps from the global model, upload delta = w_0 - w_K."""

from __future__ import annotations

from edge_client.algorithms.base import ClientAlgorithm
from edge_client.algorithms.contract import Contract, weighting

CONTRACT = Contract(
    "fedavg",
    "K local SGD steps per client; the server averages the updates",
    settings=(weighting("uniform"),),
    dp_refusal="",
    dp_requires=(("weighting", "uniform"),),
    buffered=True,
    buffered_why=(
        "its server keeps no state between aggregations and averages deltas, each a step from the model its device "
        "was sent: a staleness-weighted average of such steps is FedBuff itself"
    ),
)


class FedAvgClient(ClientAlgorithm):
    contract = CONTRACT
