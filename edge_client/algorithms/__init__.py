"""Client halves of the aggregation algorithms, one file each with its contract, looked up by the assignment's name."""

from __future__ import annotations

from edge_client.algorithms.base import ClientAlgorithm
from edge_client.algorithms.contract import Contract
from edge_client.algorithms.drag import DragClient
from edge_client.algorithms.drag_br import DragBRClient
from edge_client.algorithms.fedacg import FedACGClient
from edge_client.algorithms.fedavg import FedAvgClient
from edge_client.algorithms.fednova import FedNovaClient
from edge_client.algorithms.fedprox import FedProxClient
from edge_client.algorithms.fedprox_taco import FedProxTacoClient
from edge_client.algorithms.fedumf import FedUmfClient
from edge_client.algorithms.fedveca import FedVecaClient
from edge_client.algorithms.foolsgold import FoolsGoldClient
from edge_client.algorithms.scaffold import ScaffoldClient
from edge_client.algorithms.scaffold_taco import ScaffoldTacoClient
from edge_client.algorithms.stem import StemClient
from edge_client.algorithms.taco import TacoClient

CLIENT_ALGORITHMS: dict[str, type[ClientAlgorithm]] = {
    cls.contract.name: cls
    for cls in (
        FedAvgClient, FedProxClient, FoolsGoldClient, ScaffoldClient, StemClient, FedACGClient, TacoClient,
        FedProxTacoClient, ScaffoldTacoClient, DragClient, DragBRClient, FedUmfClient, FedNovaClient, FedVecaClient,
    )
}  # fmt: skip


#: Every algorithm's contract by name: what config validation, ``--help`` and the docs table are made from.
CONTRACTS: dict[str, Contract] = {name: cls.contract for name, cls in CLIENT_ALGORITHMS.items()}


def contract_of(name: str) -> Contract:
    try:
        return CONTRACTS[name]
    except KeyError:
        raise ValueError(f"unknown algorithm {name!r}; choose one of {sorted(CONTRACTS)}") from None


def client_algorithm(name: str) -> ClientAlgorithm:
    try:
        return CLIENT_ALGORITHMS[name]()
    except KeyError:
        raise ValueError(f"unknown algorithm {name!r}; this client supports {sorted(CLIENT_ALGORITHMS)}") from None
