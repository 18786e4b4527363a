"""SCAFFOLD server half (ALGORITHMS.md 2.0 lines 19/23, 2.4 (b); option II of the original SCAFFOLD).

    w_next = w - sum_{i in S_t} p_i delta_i                 ("Others" (i)/(ii) with eta_g = K eta_l; ``weighting``)
    c_next = (N_old c + sum_{i in S_t} delta_c_i) / N_new    c_mean_over = "contributors" (default): N counts the
                                                             clients whose updates were ever aggregated, so c is
                                                             exactly the mean of their c_i
    c_next = c + (1/N) sum_{i in S_t} delta_c_i              c_mean_over = "registered": N = ALL registered clients,
                                                             also under partial participation (2.4 (b) [EXTERNAL])

Deviation from ALGORITHMS.md 2.4 (b): by default c is the mean over the clients that contributed, not over every
registered one. A registered device whose updates are always refused (a broken or hostile one) or never arrive would
otherwise shrink every honest contribution to c by N_honest / N: with one hostile device beside three honest ones,
digits reached 78% instead of 82% after four rounds (tests/integration/test_hostile.py). Under partial participation the
registered rule lets clients not yet sampled count as c_i = 0; the contributor rule averages the c_i that exist.

``c_0 = 0`` (2.4 (d)), so round 1 is exactly FedAvg (2.4 (f)3). Each client gets ``c`` as the array ``"c"``, the
setting ``alpha`` and the value ``last_aggregated`` (the last round whose update from this client went into c, 0 =
none); it returns ``delta_c_i = c_i^new - c_i^old`` as the array ``"delta_c"`` and commits ``c_i^new`` only when a
later assignment says that round was aggregated, so ``c`` stays the mean of the ``c_i`` when updates are rejected,
late or lost.

Streaming: on arrival, ``delta_i`` is folded into FedAvg's weighted sum and ``delta_c_i`` into a plain sum; ``finish``
divides the first by its normaliser and the second by N (known then: the contributors, or the registered clients).
Two model-sized vectors besides ``c``, whatever the number of clients.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from edge_client.algorithms.scaffold import CONTRACT
from edge_client.wire.messages import Update
from edge_client.wire.plan import Plan
from server.strategies.base import Round, ServerContext, Strategy, TrainSettings
from server.strategies.common import fold_weight


class Scaffold(Strategy):
    """Server state: ``c`` (checkpointed as an array) and the last round aggregated from each client."""

    contract = CONTRACT

    def __init__(self, settings: TrainSettings, params: dict[str, Any] | None = None, seed: int = 0) -> None:
        super().__init__(settings, params, seed)
        self.c: np.ndarray | None = None
        self.aggregated: dict[str, int] = {}  # client id -> the last round whose delta_c went into c

    def setup(self, ctx: ServerContext) -> None:
        super().setup(ctx)
        if self.c is None or self.c.shape != (ctx.num_params,):
            self.c = np.zeros(ctx.num_params, dtype=np.float32)

    def assign(self, round_: int, client_id: str) -> Plan:
        assert self.c is not None, "setup() first"
        plan = super().assign(round_, client_id)
        plan.settings["last_aggregated"] = self.aggregated.get(client_id, 0)
        plan.arrays["c"] = self.c
        return plan

    def add(self, rnd: Round, update: Update) -> None:
        rnd.add("delta", update.delta, fold_weight(update, self.params["weighting"]))
        rnd.add("delta_c", update.arrays["delta_c"])

    def close(self, rnd: Round) -> np.ndarray:
        assert self.c is not None, "setup() first"
        new = rnd.weights - rnd.mean("delta")
        total = rnd.sums["delta_c"].total  # sum_i delta_c_i
        ids = [u.client_id for u in rnd.reports]
        # a new array (not in place): assignments already handed out keep the c they were given
        if self.params["c_mean_over"] == "registered":
            n_all = max(len(self.ctx.clients), len(ids))  # every registered client, selected or not
            self.c = self.c + total / np.float32(n_all)
        else:  # the sum of the contributors' c_i is N_old c; a newcomer's old c_i is 0, so its delta_c is c_i
            n_old = len(self.aggregated)
            n_new = len(set(self.aggregated) | set(ids))
            self.c = ((self.c * np.float32(n_old) + total) / np.float32(n_new)).astype(np.float32)
        self.aggregated.update((cid, rnd.number) for cid in ids)
        return new

    def round_metrics(self) -> dict[str, Any]:
        return {} if self.c is None else {"c_norm": float(np.linalg.norm(self.c))}

    def state_dict(self) -> dict[str, Any]:
        return {"c": None if self.c is None else self.c.copy(), "aggregated": dict(self.aggregated)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        c = state.get("c")
        self.c = None if c is None else np.asarray(c, dtype=np.float32)
        self.aggregated = {str(k): int(v) for k, v in state.get("aggregated", {}).items()}
