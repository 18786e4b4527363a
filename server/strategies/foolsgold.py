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

Not streamed: with the default reference every weight needs the mean of all of the round's updates, so they are kept
in the strategy's ``UpdateStore`` (RAM up to its bound, then a memory-mapped file in the run directory), their norms
and running sum taken on arrival; ``finish`` reads each one twice more (its dot with the reference, then the
rho-weighted sum), twice more per extra fixed-point iteration.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from edge_client.algorithms.foolsgold import CONTRACT
from edge_client.protocol import Update
from server.strategies.base import Round, Strategy, TrainSettings
from server.strategies.common import EPS, normalise
from server.strategies.store import UpdateStore, held_bytes


class FoolsGold(Strategy):
    """Server state: nothing with the default reference; the previous global update with ``prev_global``."""

    contract = CONTRACT

    def __init__(self, settings: TrainSettings, params: dict[str, Any] | None = None, seed: int = 0) -> None:
        super().__init__(settings, params, seed)
        self.prev_global: np.ndarray | None = None  # w_{t-1} - w_t, only with reference = "prev_global"
        self._last: dict[str, Any] = {}

    def similarity_weights(self, rows: UpdateStore, reference: np.ndarray | None) -> np.ndarray:
        """``rho_i`` against ``reference`` (clipped at 0 unless ``clip_negative`` is false); None means uniform."""
        if reference is None:
            return np.ones(len(rows))
        norms, ref_norm = np.array(rows.norms), float(np.linalg.norm(reference))
        rho = np.zeros(len(rows))
        if ref_norm >= EPS:
            ok = norms >= EPS
            rho[ok] = rows.dots(reference)[ok] / (norms[ok] * ref_norm)
        return np.maximum(rho, 0.0) if self.params["clip_negative"] else rho

    def begin(self, round_: int, weights: np.ndarray) -> Round:
        rnd = super().begin(round_, weights)
        rnd.rows = self.update_store(weights.size)
        return rnd

    def add(self, rnd: Round, update: Update) -> None:
        rnd.store().append(update.client_id, update.delta, held_bytes(update))

    def close(self, rnd: Round) -> np.ndarray:
        rows, weights = rnd.store(), rnd.weights
        n = len(rows)
        reference = self.prev_global if self.params["reference"] == "prev_global" else rows.mean()
        for it in range(self.params["fixed_point_iters"]):
            rho = self.similarity_weights(rows, reference)
            p = normalise(rho)  # uniform when sum(rho) <= EPS
            if it + 1 < self.params["fixed_point_iters"]:
                reference = rows.weighted_sum(p)
        uniform = bool(rho.sum() <= EPS) or reference is None
        step = rows.mean() if uniform else rows.weighted_sum(p)  # the uniform mean is the running sum: no pass
        if self.params["extra_1_over_N"]:
            step *= np.float32(1.0 / n)
        new = weights - step
        if self.params["reference"] == "prev_global":
            self.prev_global = (weights - new).astype(np.float32)
        self._last = {
            "rho": {cid: float(r) for cid, r in zip(rows.keys, rho, strict=True)},
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
