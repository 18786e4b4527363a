"""SCAFFOLD server half (ALGORITHMS.md 2.0 lines 19/23, 2.4 (b); option II of the original SCAFFOLD).

    w_next = w - sum_{i in S_t} p_i delta_i                 ("Others" (i)/(ii) with eta_g = K eta_l; ``weighting``)
    c_next = c + (1/N) sum_{i in S_t} delta_c_i              N = ALL registered clients, also under partial
                                                             participation (2.4 (b) [EXTERNAL: original SCAFFOLD])

``c_0 = 0`` (2.4 (d)), so round 1 is exactly FedAvg (2.4 (f)3). Each client gets ``c`` as the array ``"c"`` and
``{"alpha": alpha_for(client_id), "last_aggregated": <the last round whose update from this client went into c, 0 =
none>}``; it returns ``delta_c_i = c_i^new - c_i^old`` as the array ``"delta_c"`` and commits ``c_i^new`` only when a
later assignment says that round was aggregated, so ``c`` stays the mean of the ``c_i`` when updates are rejected,
late or lost.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import numpy as np

from edge_client.protocol import InvalidField, Update
from server.strategies.base import Instructions, ServerContext, Strategy, TrainSettings
from server.strategies.common import aggregation_weights, weighted_sum


class Scaffold(Strategy):
    """Server state: ``c`` (checkpointed as an array) and the last round aggregated from each client.

    ``alpha_for`` is the per-client coefficient hook.
    """

    name = "scaffold"
    description = "control variates: clients step along g + alpha (c - c_i); the server averages deltas and updates c"
    defaults: ClassVar[dict[str, Any]] = {"alpha": 1.0, "weighting": "uniform"}
    choices: ClassVar[dict[str, tuple[Any, ...]]] = {"weighting": ("uniform", "samples")}
    required_arrays: ClassVar[tuple[str, ...]] = ("delta_c",)

    def __init__(self, settings: TrainSettings, params: dict[str, Any] | None = None, seed: int = 0) -> None:
        super().__init__(settings, params, seed)
        if not math.isfinite(self.params["alpha"]):
            raise ValueError(f"{self.name}.alpha must be finite; got {self.params['alpha']!r}")
        self.c: np.ndarray | None = None
        self.aggregated: dict[str, int] = {}  # client id -> the last round whose delta_c went into c

    def setup(self, ctx: ServerContext) -> None:
        super().setup(ctx)
        if self.c is None or self.c.shape != (ctx.num_params,):
            self.c = np.zeros(ctx.num_params, dtype=np.float32)

    def alpha_for(self, client_id: str) -> float:
        """The correction coefficient this client uses this round."""
        return float(self.params["alpha"])

    def instructions(self, round_: int, client_id: str) -> Instructions:
        assert self.c is not None, "setup() first"
        instr = super().instructions(round_, client_id)
        instr.params["alpha"] = self.alpha_for(client_id)
        instr.params["last_aggregated"] = self.aggregated.get(client_id, 0)
        instr.arrays["c"] = self.c
        return instr

    def check_update(self, update: Update) -> None:
        super().check_update(update)
        if not np.all(np.isfinite(update.arrays["delta_c"])):
            raise InvalidField(f"{update.client_id}: scaffold updates need a finite 'delta_c'")

    def aggregate(self, round_: int, weights: np.ndarray, updates: list[Update]) -> np.ndarray:
        assert self.c is not None, "setup() first"
        p = aggregation_weights(updates, self.params["weighting"])
        new = weights - weighted_sum(p, (u.delta for u in updates), weights)
        n_all = max(len(self.ctx.clients), len(updates))  # every registered client, selected or not
        # a new array (not in place): instructions already handed out keep the c they were given
        self.c = self.c + weighted_sum(
            np.full(len(updates), 1.0 / n_all), (u.arrays["delta_c"] for u in updates), weights
        )
        self.aggregated.update((u.client_id, round_) for u in updates)
        return new

    def round_metrics(self) -> dict[str, Any]:
        return {} if self.c is None else {"c_norm": float(np.linalg.norm(self.c))}

    def state_dict(self) -> dict[str, Any]:
        return {"c": None if self.c is None else self.c.copy(), "aggregated": dict(self.aggregated)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        c = state.get("c")
        self.c = None if c is None else np.asarray(c, dtype=np.float32)
        self.aggregated = {str(k): int(v) for k, v in state.get("aggregated", {}).items()}
