"""FedProx client half (ALGORITHMS.md 2.0 line 6, 2.2): SGD on ``f_i(w) + (zeta/2)||w - w_t||^2``.

The prox term's gradient ``zeta (w - w_t)`` is added analytically to the mini-batch gradient (2.2 (g)
[RECOMMENDED]); it is never put into the loss. ``zeta * w_t`` is computed once per round, so a step costs two in-place
vector operations: ``grad += zeta * w`` then ``grad -= zeta * w_t``. ``zeta`` is TACO's name for the original
FedProx ``mu`` (2.2 (f)1).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from edge_client.algorithms.base import ClientAlgorithm, LocalContext
from edge_client.algorithms.contract import Contract, Setting, weighting

ZETA = Setting("zeta", float, 0.1, "prox coefficient: clients minimise f_i(w) + zeta/2 ||w - w_t||^2", low=0.0,
               device=True)  # fmt: skip

CONTRACT = Contract(
    "fedprox",
    "FedAvg with a proximal term zeta/2 ||w - w_t||^2 in each client's local objective",
    settings=(ZETA, weighting("uniform")),
    dp_refusal="",
    dp_requires=(("weighting", "uniform"),),
    buffered=True,
    buffered_why=(
        "FedAvg's aggregation; the proximal term pulls each device towards the model it was sent, which the device "
        "holds whatever its version"
    ),
)


class FedProxClient(ClientAlgorithm):
    """No state across rounds: the scaled prox centre lives only for the round. Subclasses change the coefficient or
    the centre by overriding ``coefficient`` / ``centre`` (FedACG does both, TACO's tailored variant the first)."""

    contract = CONTRACT

    def __init__(self) -> None:
        self._coef = 0.0
        self._scaled_centre: torch.Tensor | None = None  # coef * centre, for this round only

    def coefficient(self, ctx: LocalContext) -> float:
        """The prox coefficient of this round."""
        return float(ctx.setting("zeta"))

    def centre(self, ctx: LocalContext) -> torch.Tensor:
        """The prox centre: the model as received, ``w_t`` (2.2 (a); round 0: ``w_0``)."""
        return ctx.start

    def begin_round(self, ctx: LocalContext) -> None:
        self._coef = self.coefficient(ctx)
        self._scaled_centre = self.centre(ctx).mul(self._coef) if self._coef else None

    def correct(self, ctx: LocalContext, step: int, xb: torch.Tensor, yb: torch.Tensor) -> None:
        if self._scaled_centre is not None:  # zeta == 0 is FedAvg: nothing to add
            ctx.flat.grad.add_(ctx.flat.params, alpha=self._coef).sub_(self._scaled_centre)

    def end_round(self, ctx: LocalContext, delta: np.ndarray) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        self._scaled_centre = None  # nothing is kept across rounds
        return {}, {}
