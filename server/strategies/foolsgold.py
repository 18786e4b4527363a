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
from admission and their running sum taken on arrival; ``finish`` reads each one once more (its dot with the reference
gives its rho, and its rho-weighted add follows while it is in cache), once more per extra fixed-point iteration.
With ``prev_global`` the reference is known before the round and the dots are taken on arrival.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from edge_client.algorithms.foolsgold import CONTRACT
from edge_client.wire.messages import Update
from server.strategies.base import Round, Strategy, TrainSettings
from server.strategies.common import EPS, cosine_of
from server.strategies.store import held_bytes


class FoolsGold(Strategy):
    """Server state: nothing with the default reference; the previous global update with ``prev_global``."""

    contract = CONTRACT

    def __init__(self, settings: TrainSettings, params: dict[str, Any] | None = None, seed: int = 0) -> None:
        super().__init__(settings, params, seed)
        self.prev_global: np.ndarray | None = None  # w_{t-1} - w_t, only with reference = "prev_global"
        self._last: dict[str, Any] = {}

    def similarity_rule(self, norms: Sequence[float], reference: np.ndarray) -> Callable[[int, float], float]:
        """``rho_i`` of update i from its dot with ``reference`` (clipped at 0 unless ``clip_negative`` is false)."""
        ref_norm, clip = float(np.linalg.norm(reference)), self.params["clip_negative"]

        def rho(i: int, dot: float) -> float:
            cos = cosine_of(dot, norms[i], ref_norm)
            return max(cos, 0.0) if clip else cos

        return rho

    def begin(self, round_: int, weights: np.ndarray) -> Round:
        rnd = super().begin(round_, weights)
        previous = self.params["reference"] == "prev_global"
        rnd.rows = self.update_store(weights.size, self.prev_global if previous else None)
        return rnd

    def add(self, rnd: Round, update: Update) -> None:
        rnd.store().append(update.client_id, update.delta, held_bytes(update), rnd.delta_norm(update))

    def close(self, rnd: Round) -> np.ndarray:
        rows, weights = rnd.store(), rnd.weights
        n = len(rows)
        reference = self.prev_global if self.params["reference"] == "prev_global" else rows.mean()
        rho, weighted = np.ones(n), None  # no reference (prev_global's first round): uniform
        for it in range(self.params["fixed_point_iters"] if reference is not None else 0):
            if it:  # the next iteration's reference: the rho-weighted aggregate of this one (uniform if sum <= EPS)
                reference = weighted / np.float32(rho.sum()) if rho.sum() > EPS else rows.mean()
            rho, weighted = rows.scores(reference, self.similarity_rule(rows.norms, reference), fold=True)
        uniform = bool(rho.sum() <= EPS) or weighted is None
        step = rows.mean() if uniform else weighted / np.float32(rho.sum())  # the uniform mean: the running sum
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
