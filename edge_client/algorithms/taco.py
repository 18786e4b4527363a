"""TACO client half (ALGORITHMS.md 2.7 (a), eq. 8): SGD plus the constant tailored correction.

Each local step uses ``g + gamma (1 - alpha_i^t) Delta_t``; the term is constant within the round, so it is computed
once in ``begin_round`` and added to the flat gradient with one ``add_`` per step.

``Delta_t`` is the previous global gradient at per-step scale ((f)1, (f)2): the server's ``arrays["global_delta"]``
when sent, else derived as ``(w_{t-1} - w_t) / eta_g`` from the model this client received for version ``v - 1``
(kept across rounds, and across restarts through ``state_dict``), else - version 0 (``Delta_0 = 0``, (f)5), or the
previous model is not the immediately preceding version - no correction this round (logged). With
``delta_scale = "model_diff"`` the term uses ``eta_g * Delta_t = w_{t-1} - w_t`` instead ((f)1 option).
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch

from edge_client.algorithms.base import ClientAlgorithm, LocalContext

log = logging.getLogger("edgefl.client")


class TacoClient(ClientAlgorithm):
    name = "taco"

    def __init__(self) -> None:
        self.prev_weights: np.ndarray | None = None  # the last global model received (w_{t-1} next round)
        self.prev_version = -1
        self.corr: torch.Tensor | None = None  # gamma (1 - alpha_i) Delta_t for the current round

    def global_delta(self, ctx: LocalContext) -> torch.Tensor | None:
        """``Delta_t`` at per-step scale, or None when there is nothing to correct with."""
        a = ctx.assignment
        eta_g = float(ctx.param("eta_g", a.local_steps * a.lr))
        if "global_delta" in a.arrays:
            delta = ctx.array("global_delta")
            if delta.numel() != ctx.flat.size:
                raise ValueError(f"taco: global_delta has {delta.numel()} values, the model {ctx.flat.size}")
            return delta
        if a.model_version == 0:
            return None  # Delta_0 = 0
        prev = self.prev_weights
        if prev is not None and self.prev_version == a.model_version - 1 and prev.size == ctx.flat.size:
            return torch.from_numpy(prev).sub(ctx.start).div_(eta_g)
        log.warning(
            "round %d: taco: no global delta (model version %d, last model seen %d); no correction this round",
            a.round,
            a.model_version,
            self.prev_version,
        )
        return None

    def begin_round(self, ctx: LocalContext) -> None:
        a = ctx.assignment
        alpha = float(a.alpha if a.alpha is not None else ctx.param("alpha_init", 0.1))
        gamma = float(ctx.param("gamma", 1.0 / max(1, a.local_steps)))
        coef = gamma * (1.0 - alpha)
        if ctx.param("delta_scale", "per_step") == "model_diff":
            coef *= float(ctx.param("eta_g", a.local_steps * a.lr))
        delta = self.global_delta(ctx) if coef else None  # gamma 0: no correction (Table VI's ablation)
        self.corr = None if delta is None else delta.mul(coef)
        self.prev_weights, self.prev_version = ctx.start.numpy().copy(), int(a.model_version)

    def correct(self, ctx: LocalContext, step: int, xb: torch.Tensor, yb: torch.Tensor) -> None:
        if self.corr is not None:
            ctx.flat.grad.add_(self.corr)  # eq. 8

    def end_round(self, ctx: LocalContext, delta: np.ndarray) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        self.corr = None
        return {}, {}

    def state_dict(self) -> dict[str, np.ndarray]:
        if self.prev_weights is None:
            return {}
        return {"prev_weights": self.prev_weights, "prev_version": np.array(self.prev_version, dtype=np.int64)}

    def load_state_dict(self, state: dict[str, np.ndarray]) -> None:
        if "prev_weights" in state and "prev_version" in state:
            self.prev_weights = np.array(state["prev_weights"], dtype=np.float32)
            self.prev_version = int(state["prev_version"])
