"""FedNova server half (ALGORITHMS.md 2.10, as defined in FedVeca §II-B2): normalised averaging over unequal tau_i.

Each client runs ``tau_i = max(1, floor(E D_i / B))`` plain SGD steps (``local_steps_mode = "epochs"``; ``"fixed"``
gives everyone ``settings.local_steps``). With ``p_i = D_i / D`` renormalised over the updates received (C3,
[EXTERNAL: FedNova]) and ``tau_i`` the steps each client actually ran (``Update.local_steps``):

    G_i = delta_i / (eta tau_i),  tau_k = sum_i p_i tau_i,  d_k = sum_i p_i G_i,  w_{k+1} = w_k - eta tau_k d_k

(eq. 5; for plain SGD ``G_i`` equals the running mean of the local gradients exactly). ``eta`` cancels, so the
update is computed as ``w_k - tau_k sum_i p_i delta_i / tau_i``. Deviation from 2.10 (a): the client uploads
``delta`` rather than ``G_i``, and the server divides by the reported step count — same vector, no extra wire field.

Streaming: on arrival ``delta_i`` is folded into ``sum_i D_i delta_i / tau_i`` (its ``tau_i`` is in the update) with
the normaliser ``sum_i D_i``; ``tau_k`` is a sum of scalars over the updates that arrived, so ``finish`` needs only
the one running vector.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import numpy as np

from edge_client.algorithms.fednova import CONTRACT
from edge_client.wire.messages import Update
from edge_client.wire.plan import Plan
from server.strategies.base import Round, Strategy, TrainSettings
from server.strategies.common import aggregation_weights, fold_weight

log = logging.getLogger("edgefl.server")


class FedNova(Strategy):
    """FedNova with ``tau_i = floor(E D_i / B)``; ``epochs`` (``E``) defaults to 1.0 (the papers give no value).

    ``floor`` is taken with a 1e-9 tolerance so that e.g. ``E D_i / B = 2.9999999999`` from float rounding counts 3
    (ALGORITHMS.md 6 #24's resolution for FedVeca's tau).
    """

    contract = CONTRACT

    def __init__(self, settings: TrainSettings, params: dict[str, Any] | None = None, seed: int = 0) -> None:
        super().__init__(settings, params, seed)
        self._tau: dict[str, int] = {}
        self._tau_k = 0.0

    def local_steps_for(self, client_id: str) -> int:
        """``tau_i`` for one client (at least 1)."""
        s = self.settings
        if self.params["local_steps_mode"] == "fixed":
            return s.local_steps
        d_i = self.ctx.clients.get(client_id)
        if d_i is None:  # not registered (cannot happen in the orchestrator): fall back to the run's default
            log.warning("%s: no sample count for %s; assigning %d steps", self.name, client_id, s.local_steps)
            return s.local_steps
        return max(1, math.floor(self.params["epochs"] * d_i / s.batch_size + 1e-9))

    def assign(self, round_: int, client_id: str) -> Plan:
        plan = super().assign(round_, client_id)
        plan.steps = self.local_steps_for(client_id)
        return plan

    def add(self, rnd: Round, update: Update) -> None:
        rnd.add("delta", update.delta, fold_weight(update, "samples"), 1.0 / update.local_steps)

    def close(self, rnd: Round) -> np.ndarray:
        p = aggregation_weights(rnd.reports, "samples")
        tau = np.array([u.local_steps for u in rnd.reports], dtype=np.float64)
        tau_k = float(np.dot(p, tau))
        self._tau = {u.client_id: int(u.local_steps) for u in rnd.reports}
        self._tau_k = tau_k
        # eta tau_k d_k = eta tau_k sum_i p_i delta_i / (eta tau_i)
        return (rnd.weights - np.float32(tau_k) * rnd.mean("delta")).astype(np.float32, copy=False)

    def round_metrics(self) -> dict[str, Any]:
        return {"tau": dict(self._tau), "tau_k": self._tau_k}
