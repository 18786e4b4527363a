"""TACO-tailored FedProx client half (ALGORITHMS.md 2.7 (f)13, TACO Fig. 6): FedProx with ``zeta_i = zeta (1 -
alpha_i)``, where ``alpha_i`` is the client's TACO coefficient (eq. 7) that the server computes from each round's
uploads and sends as the plan's value ``alpha_i`` (``alpha_init`` until the client's first upload)."""

from __future__ import annotations

from edge_client.algorithms.base import LocalContext
from edge_client.algorithms.fedprox import CONTRACT as FEDPROX
from edge_client.algorithms.fedprox import FedProxClient
from edge_client.algorithms.taco import tailored, tailored_contract

CONTRACT = tailored_contract(
    FEDPROX, "FedProx with per-client zeta_i = zeta (1 - alpha_i), alpha_i TACO's eq. 7 coefficient"
)


class FedProxTacoClient(FedProxClient):
    contract = CONTRACT

    def coefficient(self, ctx: LocalContext) -> float:
        return tailored(super().coefficient(ctx), ctx)
