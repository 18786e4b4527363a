"""FedProx client half (ALGORITHMS.md 2.0 line 6, 2.2): SGD on ``f_i(w) + (zeta/2)||w - w_t||^2``.

The prox term's gradient ``zeta (w - w_t)`` is added analytically to the mini-batch gradient (2.2 (g)
[RECOMMENDED]); it is never put into the loss. ``zeta * w_t`` is computed once per round, so a step costs two in-place
vector operations: ``grad += zeta * w`` then ``grad -= zeta * w_t``.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from edge_client.algorithms.base import ClientAlgorithm, LocalContext


class FedProxClient(ClientAlgorithm):
    """Reads ``zeta`` from the assignment every round (the server may send each client its own value).

    No state across rounds: the scaled prox centre lives only for the round. Subclasses change the coefficient or
    the centre by overriding ``coefficient`` / ``centre`` (FedACG does both).
    """

    name = "fedprox"
    coefficient_name = "zeta"

    def __init__(self) -> None:
        self._coef = 0.0
        self._scaled_centre: torch.Tensor | None = None  # coef * centre, for this round only

    def coefficient(self, ctx: LocalContext) -> float:
        """The prox coefficient of this round, as sent by the server (a missing value is an error, not 0)."""
        value = ctx.param(self.coefficient_name)
        if value is None:
            raise ValueError(f"{self.name}: the assignment carries no {self.coefficient_name!r}")
        coef = float(value)
        if not math.isfinite(coef) or coef < 0:
            raise ValueError(f"{self.name}: {self.coefficient_name} must be a finite number >= 0; got {value!r}")
        return coef

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
