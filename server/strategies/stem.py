"""STEM server half (ALGORITHMS.md 2.5, TACO Algorithm 1 line 21).

As printed, ``Delta_{t+1} = 1/(K N eta_l) sum_i (Delta_i + v_{i,K-1})`` and ``w_{t+1} = w_t - eta_g Delta_{t+1}``;
with ``eta_g = K eta_l`` (C2) that is ``w_{t+1} = w_t - mean_i delta_i - server_v_coeff * mean_i v_i``.

Resolutions chosen (2.5 (f)):

* (3) ``server_v_coeff`` defaults to 1.0, the [LITERAL] rule TACO's STEM numbers need (an extra server step of rate 1
  along the mean momentum, which mixes a model difference with a gradient-scale vector); the alternatives of (f)3 are
  the numbers ``eta_l`` or ``K * eta_l``, written as the value of ``server_v_coeff``.
* (2) ``alpha`` (``alpha_t``) is the constant 0.2 [RECOMMENDED]; the paper gives no update rule.
* (1) ``init`` = ``"grad"`` (default: ``v_0 = g_0``) or ``"server_avg"``: the server also sends
  ``v_bar`` = the weighted mean of last round's ``v_i`` (``arrays["v_bar"]``, d floats more per client); none in
  round 1 or before any round aggregated ((f)5: the client falls back to ``"grad"``).
* ``weighting`` defaults to ``"uniform"`` (the printed ``1/N``, C3); ``"samples"`` weights delta and v by ``D_i/D``.

Streaming: ``delta_i`` and ``v_i`` are folded on arrival into two running weighted sums with one normaliser, divided
in ``finish``. Two model-sized vectors, whatever the number of clients.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from edge_client.algorithms.stem import CONTRACT
from edge_client.wire.messages import Update
from edge_client.wire.plan import Plan
from server.strategies.base import Round, Strategy, TrainSettings
from server.strategies.common import fold_weight


class Stem(Strategy):
    contract = CONTRACT

    def __init__(self, settings: TrainSettings, params: dict[str, Any] | None = None, seed: int = 0) -> None:
        super().__init__(settings, params, seed)
        self.v_bar: np.ndarray | None = None  # weighted mean of the last aggregated round's v_i ("server_avg")

    def assign(self, round_: int, client_id: str) -> Plan:
        plan = super().assign(round_, client_id)
        if self.params["init"] == "server_avg" and self.v_bar is not None:
            plan.arrays["v_bar"] = self.v_bar
        return plan

    def add(self, rnd: Round, update: Update) -> None:
        weight = fold_weight(update, self.params["weighting"])
        rnd.add("delta", update.delta, weight)
        rnd.add("v", update.arrays["v"], weight)

    def close(self, rnd: Round) -> np.ndarray:
        mean_v = rnd.mean("v")
        if self.params["init"] == "server_avg":
            self.v_bar = mean_v.copy()
        return rnd.weights - rnd.mean("delta") - np.float32(self.params["server_v_coeff"]) * mean_v

    def round_metrics(self) -> dict[str, Any]:
        return {"alpha": self.params["alpha"]}

    def state_dict(self) -> dict[str, Any]:
        """``v_bar`` (an npz array in the checkpoint; only with ``init = "server_avg"``)."""
        return {"v_bar": None if self.v_bar is None else self.v_bar.copy()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        v_bar = state.get("v_bar")
        self.v_bar = None if v_bar is None else np.asarray(v_bar, dtype=np.float32)
