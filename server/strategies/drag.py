"""DRAG server half (ALGORITHMS.md 2.8 (b), normal variant): drag every update toward a reference direction.

DRAG is written in increments (``g_m = theta_m^{t,U} - theta^t``); the wire carries descent-positive deltas (C1). To
avoid sign slips (2.8 (e)) this half works in the paper's increment convention throughout: ``g_m = -delta_m`` on
arrival, ``theta_{t+1} = theta_t + mean_m v_m`` on return ((f)1 [RECOMMENDED]: the "-" of Step 3 is a typo, cf.
eq. 4 and proof eq. 20). Per round, with ``S`` = the updates received and uniform weights ``1/S`` ((f)11):

* reference ``r``: mean of the current increments in the first aggregation (eq. 6, t = 0, (f)4), afterwards the
  recursion ``r <- (1 - alpha) r + alpha Delta`` (eq. 6; the closed form eq. 7 is a typo, (f)2);
* degree of divergence ``lambda_m = c (1 - cos(g_m, r))`` (eq. 10; ``angle_approx`` (f)6 selects the alternatives);
* dragged update ``v_m = (1 - lambda_m) g_m + lambda_m (|g_m| / |r|) r`` (eq. 11); ``Delta = mean_m v_m`` (eq. 8).

Degenerate norms ((f)5, C5): ``|g_m| = 0`` gives ``v_m = 0`` (the formula itself); ``|r| < eps`` skips dragging
(``v_m = g_m``, reported as ``lambda_m = 0``).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from edge_client.algorithms.drag import ANGLE_APPROX, CONTRACT
from edge_client.protocol import Update
from server.strategies.base import Strategy, TrainSettings
from server.strategies.common import EPS, cosine


def degree_of_divergence(cos: float, c: float, approx: str) -> float:
    """``lambda = c * angle / (pi/2)`` with the angle approximated as chosen (eq. 9-10, (f)6); in ``[0, 2c]``."""
    if approx == "linear_pi_over_2":
        return c * (1.0 - cos)
    if approx == "linear_unit":
        return c * (1.0 - (2.0 / math.pi) * cos)
    if approx == "exact_arccos":
        return c * math.acos(min(1.0, max(-1.0, cos))) / (math.pi / 2.0)
    raise ValueError(f"angle_approx must be one of {list(ANGLE_APPROX.choices)}; got {approx!r}")


class Drag(Strategy):
    """DRAG with a momentum reference (eq. 6, 8, 10, 11); with ``alpha = 1`` the reference is simply last round's
    aggregate ``Delta^{t-1}`` ((f)3)."""

    contract = CONTRACT

    def __init__(self, settings: TrainSettings, params: dict[str, Any] | None = None, seed: int = 0) -> None:
        super().__init__(settings, params, seed)
        self.r: np.ndarray | None = None  # reference for the next aggregation (increment convention)
        self._lambdas: dict[str, float] = {}

    def aggregate(self, round_: int, weights: np.ndarray, updates: list[Update]) -> np.ndarray:
        share = np.float32(1.0 / len(updates))
        if self.r is None:  # eq. 6, t = 0: the mean of this round's raw increments
            self.r = np.zeros_like(weights, dtype=np.float32)
            for u in updates:
                self.r -= u.delta.astype(np.float32) * share
        r = self.r
        r_norm = float(np.linalg.norm(r))
        c, approx = self.params["c"], self.params["angle_approx"]
        agg = np.zeros_like(weights, dtype=np.float32)  # Delta^t = (1/S) sum v_m (eq. 8), one update at a time
        self._lambdas = {}
        for u in updates:
            g = np.negative(u.delta, dtype=np.float32)
            if r_norm < EPS:  # (f)5: no reference direction, no dragging
                self._lambdas[u.client_id] = 0.0
                agg += g * share
                continue
            lam = degree_of_divergence(cosine(g, r), c, approx)
            self._lambdas[u.client_id] = lam
            g_norm = float(np.linalg.norm(g))
            agg += g * np.float32((1.0 - lam) / len(updates))  # eq. 11, first term
            agg += r * np.float32(lam * g_norm / r_norm / len(updates))  # eq. 11, second term
        alpha = self.params["alpha"]
        self.r = (r * np.float32(1.0 - alpha) + agg * np.float32(alpha)).astype(np.float32)  # eq. 6 for t + 1
        return (weights + agg).astype(np.float32)  # theta^{t+1} = theta^t + Delta^t ((f)1)

    def round_metrics(self) -> dict[str, Any]:
        return {"lambda": dict(self._lambdas)}

    def state_dict(self) -> dict[str, Any]:
        return {"r": None if self.r is None else self.r.copy()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        r = state.get("r")
        self.r = None if r is None else np.asarray(r, dtype=np.float32)
