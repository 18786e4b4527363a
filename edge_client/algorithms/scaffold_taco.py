"""TACO-tailored SCAFFOLD client half (ALGORITHMS.md 2.7 (f)13, TACO Fig. 6): SCAFFOLD whose correction is scaled by
``alpha (1 - alpha_i)``, with ``alpha`` SCAFFOLD's own coefficient (1 by default, giving (f)13's ``1 - alpha_i``) and
``alpha_i`` the client's TACO coefficient sent as the plan's value ``alpha_i``. Its ``c_i`` state is kept under this
name's state file, and committed only once the server says it aggregated that round (scaffold.py)."""

from __future__ import annotations

from edge_client.algorithms.base import LocalContext
from edge_client.algorithms.scaffold import CONTRACT as SCAFFOLD
from edge_client.algorithms.scaffold import ScaffoldClient
from edge_client.algorithms.taco import tailored, tailored_contract

CONTRACT = tailored_contract(
    SCAFFOLD, "SCAFFOLD with per-client coefficient alpha (1 - alpha_i), alpha_i TACO's eq. 7 coefficient"
)


class ScaffoldTacoClient(ScaffoldClient):
    contract = CONTRACT

    def coefficient(self, ctx: LocalContext) -> float:
        return tailored(super().coefficient(ctx), ctx)
