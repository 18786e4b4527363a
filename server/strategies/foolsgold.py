"""FoolsGold server half, TACO's aggregation-calibration variant (ALGORITHMS.md 2.3, [RECOMMENDED] executable form).

Each update is weighted by its cosine to a reference direction:

    r     = (1/|S_t|) sum_j delta_j                       reference = "current_mean" (2.3 (f)1 [RECOMMENDED])
    rho_i = max(0, cos(delta_i, r))                       clip_negative = true (2.3 (f)3), cosine guard C5
    if sum_j rho_j <= eps: rho_i = 1 for all i            uniform fallback (C5)
    w_next = w - sum_i rho_i delta_i / sum_j rho_j        (eta_g = K eta_l; the printed extra 1/N is dropped, 2.3 (f)2)

Options: ``reference = "prev_global"`` uses the previous global update ``w_{t-1} - w_t`` (a positive multiple of TACO's
``Delta_t``, and the cosine is scale-invariant); there is none in the first round, which then uses uniform weights
(2.3 (f)1). ``fixed_point_iters = n`` evaluates rho n times, each time against the rho-weighted aggregate of the
previous evaluation (a literal reading of the circular definition; n = 1 is the executable form above).
``extra_1_over_N = true`` ([LITERAL]) multiplies the step by ``1/|S_t|``, the N of line 20 under TACO's full
participation. This is not the original FoolsGold (Fung et al.), which keeps per-client histories (2.3 (f)4).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from edge_client.algorithms.foolsgold import CONTRACT
from edge_client.protocol import Update
from server.strategies.base import Strategy, TrainSettings
from server.strategies.common import EPS, cosine, normalise, weighted_sum


class FoolsGold(Strategy):
    """Server state: nothing with the default reference; the previous global update with ``prev_global``."""

    contract = CONTRACT

    def __init__(self, settings: TrainSettings, params: dict[str, Any] | None = None, seed: int = 0) -> None:
        super().__init__(settings, params, seed)
        self.prev_global: np.ndarray | None = None  # w_{t-1} - w_t, only with reference = "prev_global"
        self._last: dict[str, Any] = {}

    def similarity_weights(self, deltas: list[np.ndarray], reference: np.ndarray | None) -> np.ndarray:
        """``rho_i`` against ``reference`` (clipped at 0 unless ``clip_negative`` is false); None means uniform."""
        if reference is None:
            return np.ones(len(deltas))
        rho = np.array([cosine(d, reference) for d in deltas])
        return np.maximum(rho, 0.0) if self.params["clip_negative"] else rho

    def aggregate(self, round_: int, weights: np.ndarray, updates: list[Update]) -> np.ndarray:
        deltas = [u.delta for u in updates]
        n = len(deltas)
        if self.params["reference"] == "prev_global":
            reference = self.prev_global
        else:
            reference = weighted_sum(np.full(n, 1.0 / n), deltas, weights)
        for it in range(self.params["fixed_point_iters"]):
            rho = self.similarity_weights(deltas, reference)
            p = normalise(rho)  # uniform when sum(rho) <= EPS
            if it + 1 < self.params["fixed_point_iters"]:
                reference = weighted_sum(p, deltas, weights)
        step = weighted_sum(p, deltas, weights)
        if self.params["extra_1_over_N"]:
            step *= np.float32(1.0 / n)
        new = weights - step
        if self.params["reference"] == "prev_global":
            self.prev_global = (weights - new).astype(np.float32)
        self._last = {
            "rho": {u.client_id: float(r) for u, r in zip(updates, rho, strict=True)},
            "uniform_fallback": bool(rho.sum() <= EPS),
        }
        return new

    def round_metrics(self) -> dict[str, Any]:
        return dict(self._last)

    def state_dict(self) -> dict[str, Any]:
        return {"prev_global": None if self.prev_global is None else self.prev_global.copy()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        prev = state.get("prev_global")
        self.prev_global = None if prev is None else np.asarray(prev, dtype=np.float32)
