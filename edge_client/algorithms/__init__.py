"""Client halves of the aggregation algorithms, one file each, looked up by the name in the assignment."""

from __future__ import annotations

from edge_client.algorithms.base import ClientAlgorithm
from edge_client.algorithms.fedavg import FedAvgClient

CLIENT_ALGORITHMS: dict[str, type[ClientAlgorithm]] = {
    FedAvgClient.name: FedAvgClient,
}


def client_algorithm(name: str) -> ClientAlgorithm:
    try:
        return CLIENT_ALGORITHMS[name]()
    except KeyError:
        raise ValueError(f"unknown algorithm {name!r}; this client supports {sorted(CLIENT_ALGORITHMS)}") from None
