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

Streaming with the previous round's reference: ``lambda_m`` needs only ``g_m`` and ``r``, so on arrival each update is
folded as ``sum_m (1 - lambda_m) g_m`` (one vector) and the scalar ``sum_m lambda_m |g_m| / |r|``; ``finish`` forms
``Delta = (that sum + that scalar r) / S``. Per update: its dot with ``r`` (one read from memory) and one scaled add
(from cache); its norm is the one admission measured. The first aggregation has no reference yet (eq. 6, t = 0: the
mean of the round's own uploads), so its uploads are kept in the strategy's ``UpdateStore`` and folded the same way
in ``finish``, once their mean is known.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from edge_client.algorithms.drag import ANGLE_APPROX, CONTRACT
from edge_client.wire.messages import Update
from server.strategies.base import Round, Strategy, TrainSettings
from server.strategies.common import EPS, axpy, cosine_of
from server.strategies.store import held_bytes


def degree_of_divergence(cos: float, c: float, approx: str) -> float:
    """``lambda = c * angle / (pi/2)`` with the angle approximated as chosen (eq. 9-10, (f)6); in ``[0, 2c]``."""
    if approx == "linear_pi_over_2":
        return c * (1.0 - cos)
    if approx == "linear_unit":
        return c * (1.0 - (2.0 / math.pi) * cos)
    if approx == "exact_arccos":
        return c * math.acos(min(1.0, max(-1.0, cos))) / (math.pi / 2.0)
    raise ValueError(f"angle_approx must be one of {list(ANGLE_APPROX.choices)}; got {approx!r}")


def increment_cosine(delta: np.ndarray, delta_norm: float, r: np.ndarray, r_norm: float) -> float:
    """``cos(g, r)`` with ``g = -delta`` (C5 guard), without making ``g``: ``-delta.r / (|delta| |r|)``."""
    return cosine_of(-float(np.dot(delta, r)), delta_norm, r_norm)


@dataclass(eq=False)
class DragRound(Round):
    """A DRAG round in progress: its reference and the running ``sum_m c_m g_m`` and ``sum_m k_m`` of
    ``Delta = (1/S) (sum_m c_m g_m + (sum_m k_m) r)`` (eq. 8, 11 or 14)."""

    r: np.ndarray | None = None
    r_norm: float = 0.0
    g_sum: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.float32))
    r_coef: float = 0.0
    lambdas: dict[str, float] = field(default_factory=dict)

    def delta(self) -> np.ndarray:
        """``Delta^t`` of eq. 8 over the folded updates (increment convention)."""
        assert self.r is not None
        agg = axpy(self.g_sum, self.r, self.r_coef)  # in place: the round is over
        agg *= np.float32(1.0 / len(self.reports))
        return agg


class Drag(Strategy):
    """DRAG with a momentum reference (eq. 6, 8, 10, 11); with ``alpha = 1`` the reference is simply last round's
    aggregate ``Delta^{t-1}`` ((f)3)."""

    contract = CONTRACT

    def __init__(self, settings: TrainSettings, params: dict[str, Any] | None = None, seed: int = 0) -> None:
        super().__init__(settings, params, seed)
        self.r: np.ndarray | None = None  # reference for the next aggregation (increment convention)
        self._lambdas: dict[str, float] = {}

    def begin(self, round_: int, weights: np.ndarray) -> Round:
        rnd = DragRound(round_, weights, g_sum=np.zeros(weights.size, dtype=np.float32))
        if self.r is None:  # eq. 6, t = 0: the reference is the mean of this round's uploads, kept until all are in
            rnd.rows = self.update_store(weights.size)
        else:
            rnd.r, rnd.r_norm = self.r, float(np.linalg.norm(self.r))
        return rnd

    def add(self, rnd: Round, update: Update) -> None:
        assert isinstance(rnd, DragRound)
        if rnd.r is None:
            rnd.store().append(update.client_id, update.delta, held_bytes(update), rnd.delta_norm(update))
        else:
            self._drag(rnd, update.client_id, update.delta, rnd.delta_norm(update))

    def _drag(self, rnd: DragRound, client_id: str, delta: np.ndarray, delta_norm: float) -> None:
        """Fold ``v_m`` of eq. 11 for ``g_m = -delta`` against ``rnd.r``."""
        assert rnd.r is not None
        if rnd.r_norm < EPS:  # (f)5: no reference direction, no dragging
            rnd.lambdas[client_id] = 0.0
            rnd.g_sum = axpy(rnd.g_sum, delta, -1.0)
            return
        cos = increment_cosine(delta, delta_norm, rnd.r, rnd.r_norm)
        lam = degree_of_divergence(cos, self.params["c"], self.params["angle_approx"])
        rnd.lambdas[client_id] = lam
        rnd.g_sum = axpy(rnd.g_sum, delta, -(1.0 - lam))  # eq. 11, first term
        rnd.r_coef += lam * delta_norm / rnd.r_norm  # eq. 11, second term's coefficient

    def close(self, rnd: Round) -> np.ndarray:
        assert isinstance(rnd, DragRound)
        if rnd.r is None:  # the first aggregation: its reference is the mean of its increments, -mean(delta)
            rows = rnd.store()
            rnd.r = np.negative(rows.mean())
            rnd.r_norm = float(np.linalg.norm(rnd.r))
            for cid, row, norm in zip(rows.keys, rows, rows.norms, strict=True):
                self._drag(rnd, cid, row, norm)
        r = rnd.r
        agg = rnd.delta()
        self._lambdas = rnd.lambdas
        alpha = self.params["alpha"]
        self.r = agg if alpha == 1.0 else axpy(r * np.float32(1.0 - alpha), agg, alpha)  # eq. 6 for t + 1
        return (rnd.weights + agg).astype(np.float32, copy=False)  # theta^{t+1} = theta^t + Delta^t ((f)1)

    def round_metrics(self) -> dict[str, Any]:
        return {"lambda": dict(self._lambdas)}

    def state_dict(self) -> dict[str, Any]:
        return {"r": None if self.r is None else self.r.copy()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        r = state.get("r")
        self.r = None if r is None else np.asarray(r, dtype=np.float32)
