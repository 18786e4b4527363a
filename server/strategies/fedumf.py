"""FedUmf server half (ALGORITHMS.md 2.9): partial participation where the unselected clients train too.

Round t (1-based, as the paper): ``S_t`` is a uniform sample without replacement of ``M = max(1, round(C n))`` of
the ``n`` available clients (C = ``clients.fraction``, C9); every other available client is told to train without
uploading (``train_only``), so it can store its increment and fuse it when it is selected again (client half).
The next model is the FedAvg average of the selected clients' uploaded models,
``w_{t+1} = sum_{i in S_t} p_i w_{i,end} = w_t - sum_i p_i delta_i`` (the deltas of fused clients contain the fused
increment, 2.9 (e)).

Resolutions chosen (2.9 (f)):

* ``local_unit`` defaults to ``"steps"``, NOT ALGORITHMS.md's [RECOMMENDED] ``"epochs"`` ((f)2): the run's
  ``train.local_steps`` is the one K every algorithm of a comparison shares, so FedUmf honours it instead of silently
  replacing it by an epoch count; ``"epochs"`` gives client i ``ceil(D_i / B) * epochs`` steps (the paper's
  one-epoch reading).
* ``weighting`` defaults to ``"samples"`` (``p_i = D_i / D`` over the uploads, (f)8 / (b) [RECOMMENDED]); with equal
  shards this is the paper's ``1/M``. (Table C3 lists uniform for FedUmf; (f)8 is the more specific rule.)
* ``lr_decay``: ``eta_t = lr * lr_decay**(t-1)`` (the appendix's 0.998); the client's fusion factor is
  ``alpha * eta_t / eta_{t-1}`` ((f)5), with ``eta_0 := eta_1`` (round 1 fuses nothing anyway, (f)4).
* The local optimiser (C7: SGD with momentum 0.5 and weight decay 5e-4 in the paper) is the run's, ``train.momentum``
  and ``train.weight_decay``, shared by every algorithm, so a comparison with FedAvg uses the same optimiser on both
  sides (the fedumf-mnist suite sets the paper's values for all). Its default is plain SGD, as for every algorithm.

Streaming: FedAvg's (the selected clients' deltas folded on arrival into a running weighted sum and its normaliser).
"""

from __future__ import annotations

import math
from typing import Any

from edge_client.algorithms.fedumf import CONTRACT
from edge_client.wire.plan import Plan
from server.strategies.base import TrainSettings
from server.strategies.fedavg import FedAvg


class FedUmf(FedAvg):
    """FedAvg's aggregation; selection, train-only clients and the per-round learning rate are FedUmf's own."""

    contract = CONTRACT

    def __init__(self, settings: TrainSettings, params: dict[str, Any] | None = None, seed: int = 0) -> None:
        super().__init__(settings, params, seed)
        self.selected: list[str] = []
        self.trained_only: list[str] = []

    def lr_at(self, round_: int) -> float:
        """``eta_t = lr * lr_decay**(t-1)`` for 1-based rounds; rounds before 1 use ``eta_1``."""
        return self.settings.lr * self.params["lr_decay"] ** max(0, round_ - 1)

    def select(self, round_: int, available: list[str]) -> list[str]:
        """``M = max(1, round(C n))`` clients, uniformly without replacement (C9)."""
        count = min(len(available), max(1, round(self.settings.fraction * len(available))))
        self.selected = sorted(self.rng.choice(available, size=count, replace=False).tolist()) if available else []
        return list(self.selected)

    def train_only(self, round_: int, available: list[str], selected: list[str]) -> list[str]:
        """Every available client not selected: it trains on the broadcast model and keeps its update."""
        chosen = set(selected)
        self.trained_only = sorted(c for c in available if c not in chosen)
        return list(self.trained_only)

    def local_steps_for(self, client_id: str) -> int:
        s = self.settings
        if self.params["local_unit"] == "steps":
            return s.local_steps
        samples = self.ctx.clients.get(client_id, 0)
        if samples <= 0:  # unknown size (not registered): fall back to the run's K
            return s.local_steps
        return math.ceil(samples / s.batch_size) * self.params["epochs"]

    def assign(self, round_: int, client_id: str) -> Plan:
        plan = super().assign(round_, client_id)
        plan.steps, plan.lr = self.local_steps_for(client_id), self.lr_at(round_)
        plan.settings["lr_prev"] = self.lr_at(round_ - 1)
        return plan

    def round_metrics(self) -> dict[str, Any]:
        return {"selected": list(self.selected), "train_only": list(self.trained_only)}

    def state_dict(self) -> dict[str, Any]:
        return {"selected": list(self.selected), "train_only": list(self.trained_only)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.selected = list(state.get("selected", []))
        self.trained_only = list(state.get("train_only", []))
