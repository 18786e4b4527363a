"""TACO client half (ALGORITHMS.md 2.7 (a), eq. 8): SGD plus the constant tailored correction.

Each local step uses ``g + gamma (1 - alpha_i^t) Delta_t``, with ``alpha_i^t`` the plan's per-round value ``alpha_i``
(``ALPHA_I``, declared by TACO's contract and the tailored variants' like FedVeca's ``P``); the term is
constant within the round, so it is computed once in ``begin_round`` and added to the flat gradient with one ``add_``
per step. ``gamma = 0`` means ``1/K`` with K this round's local steps.

``Delta_t`` comes from the last global step ``w_{t-1} - w_t``: the server's ``arrays["global_delta"]`` when sent, else
derived from the model this client received for version ``v - 1`` (kept across rounds, and across restarts through
``state_dict``), else - version 0 (``Delta_0 = 0``, (f)5), or the previous model is not the immediately preceding
version - no correction this round (logged). ``correction`` sets its scale (docs/algorithms.md, "TACO's correction
scale", gives the paper's evidence): ``"accumulated"`` (default) ``Delta_t = (w_{t-1} - w_t) / eta_l``, the
accumulated global gradient, so that with gamma = 1/K the K steps of a round add ``(1 - alpha_i)(w_{t-1} - w_t)``,
Lemma 1's momentum; ``"per_step"`` ``(w_{t-1} - w_t) / (K eta_l)`` (ALGORITHMS.md (f)1; with gamma = 1/K only 1/K of
that); ``"model_diff"`` ``w_{t-1} - w_t`` itself.

The contract here is TACO's whole contract, server settings included (expulsion, output z); the tailored FedProx and
SCAFFOLD variants reuse ``ALPHA_INIT``, ``ALPHA_REFERENCE`` and ``tailored``. ``tailored_correction = false``
(Table VI's ablation) makes the device run eq. 4's plain SGD.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import numpy as np
import torch

from edge_client.algorithms.base import ClientAlgorithm, LocalContext
from edge_client.algorithms.contract import Array, Contract, Setting, Value

log = logging.getLogger("edgefl.client")

#: alpha_i^0: the TACO coefficient of a client that has not uploaded yet (Algorithm 2's initialisation)
ALPHA_INIT = Setting("alpha_init", float, 0.1, "alpha_i of a client before its first upload", low=0.0, high=1.0,
                     high_open=True)  # fmt: skip
#: what eq. 7's cosine is taken against (ALGORITHMS.md 2.7 (f)4; docs/algorithms.md says why "mean" is the default)
ALPHA_REFERENCE = Setting("alpha_reference", str, "mean",
                          "eq. 7's cosine against the mean upload ('mean', the equation) or the global update the "
                          "clients were sent ('previous_global', the prose)",
                          choices=("mean", "previous_global"))  # fmt: skip

#: alpha_i^t, the per-round value the server sends each client of TACO and its tailored variants: eq. 7 from the
#: client's last upload (``alpha_init`` before its first), a product of a share and a clamped cosine, so in [0, 1]
ALPHA_I = Value("alpha_i", "TACO's alpha_i of this client (eq. 7), tailoring its correction (eq. 8)", high=1.0,
                example=ALPHA_INIT.default)  # fmt: skip

CONTRACT = Contract(
    "taco",
    "tailored per-client correction (alpha_i), alpha-weighted aggregation, freeloader expulsion",
    settings=(
        Setting("gamma", float, 0.0, "largest correction factor of eq. 8 (0: 1/K)", low=0.0, device=True),
        Setting("kappa", float, 0.6, "eq. 10: a client whose alpha_i reaches kappa gets a strike", low=0.0, high=1.0),
        Setting("lambda_expel", int, 0, "strikes before expulsion (0: round(rounds / 5))", low=0),
        Setting("rounds", int, 0, "T, the run's total rounds, for the lambda default (0: taken from run.rounds)",
                low=0),
        ALPHA_INIT,
        Setting("send_global_delta", bool, False, "always send w_{t-1} - w_t instead of letting clients derive it"),
        Setting("correction", str, "accumulated",
                "eq. 8's Delta_t: (w_{t-1} - w_t) / eta_l ('accumulated', Lemma 1), / (K eta_l) ('per_step') or "
                "w_{t-1} - w_t ('model_diff')", choices=("accumulated", "per_step", "model_diff"), device=True),
        Setting("aggregation", str, "stabilised",
                "eq. 9's weights: the round's alphas ('paper') or smoothed across rounds and mixed with uniform "
                "weights ('stabilised', beyond the paper)", choices=("stabilised", "paper")),
        Setting("alpha_smoothing", float, 0.5,
                "stabilised aggregation: weight of a client's previous smoothed alpha in its new one (0: this "
                "round's alpha)",
                low=0.0, high=1.0, high_open=True),
        Setting("uniform_share", float, 0.5, "stabilised: share of eq. 9's weights spread uniformly over the round",
                low=0.0, high=1.0),
        Setting("detection", str, "stabilised",
                "eq. 10's strikes: alpha_i >= kappa ('paper'), or only for the clients above the widest gap (at "
                "least strike_gap) in the round's sorted alphas, fewer than half ('stabilised', beyond the paper)",
                choices=("stabilised", "paper")),
        Setting("strike_gap", float, 0.2, "stabilised detection: the least gap between suspects and the others' alphas",
                low=0.0, high=1.0, low_open=True),
        Setting("output", str, "z", "also evaluate eq. 15's z ('z') or only w ('w')", choices=("z", "w")),
        Setting("drop_on_expel_round", bool, False, "drop an expelled client's update of its expulsion round"),
        ALPHA_REFERENCE,
        Setting("tailored_correction", bool, True, "eq. 8's correction on the device (false: plain SGD, Table VI)",
                device=True),
        Setting("tailored_aggregation", bool, True, "eq. 9's alpha weights (false: uniform average, Table VI)"),
    ),
    sends=(Array("global_delta", "w_{t-1} - w_t, the last global step, for clients that cannot derive it",
                 required=False, scope="global"),),
    sends_values=(ALPHA_I,),
    needs="per_device",
    needs_why="each device's alpha_i from its own update, and freeloader expulsion",
    dp_refusal=(
        "TACO's alpha_i is computed from each device's own update and "
        "sent back to it: a per-device release the noise does not cover"
    ),
    buffered=False,
    buffered_why=(
        "alpha_i (eq. 7) and freeloader expulsion compare each update with the mean of the round's updates of one "
        "model version: updates of several versions have no common mean"
    ),
)  # fmt: skip


#: ``correction`` -> the divisor turning ``w_{t-1} - w_t`` into eq. 8's ``Delta_t``, from K and eta_l
DELTA_SCALE = {
    "accumulated": lambda steps, lr: lr,
    "per_step": lambda steps, lr: steps * lr,
    "model_diff": lambda steps, lr: 1.0,
}


def tailored_contract(base: Contract, description: str) -> Contract:
    """``base`` with TACO's alpha_i tailoring its correction (2.7 (f)13): the plans carry the value ``alpha_i``, and
    the server needs ``alpha_init`` for clients that have not uploaded yet and ``alpha_reference`` for eq. 7."""
    settings = (*base.settings, ALPHA_INIT, ALPHA_REFERENCE)
    values = (*base.sends_values, ALPHA_I)
    return dataclasses.replace(
        base, name=f"{base.name}-taco", description=description, settings=settings, sends_values=values,
        needs="per_device", needs_why="each device's alpha_i from its own update",
        dp_refusal=CONTRACT.dp_refusal, dp_requires=(),
        buffered=False, buffered_why=f"{base.name} tailored by TACO's alpha_i: {CONTRACT.buffered_why}",
    )  # fmt: skip


def tailored(coefficient: float, ctx: LocalContext) -> float:
    """``coefficient (1 - alpha_i)``: TACO's tailoring of a correction by the client's own alpha (eq. 8, (f)13)."""
    return coefficient * (1.0 - float(ctx.setting(ALPHA_I.name)))


class TacoClient(ClientAlgorithm):
    contract = CONTRACT

    def __init__(self) -> None:
        self.prev_weights: np.ndarray | None = None  # the last global model received (w_{t-1} next round)
        self.prev_version = -1
        self.corr: torch.Tensor | None = None  # gamma (1 - alpha_i) Delta_t for the current round

    def global_step(self, ctx: LocalContext) -> torch.Tensor | None:
        """``w_{t-1} - w_t``, or None when there is nothing to correct with."""
        facts = ctx.facts
        if ctx.has_array("global_delta"):
            return ctx.array("global_delta")
        if facts.model_version == 0:
            return None  # Delta_0 = 0
        prev = self.prev_weights
        if prev is not None and self.prev_version == facts.model_version - 1 and prev.size == ctx.flat.size:
            return torch.from_numpy(prev).sub(ctx.start)
        log.warning(
            "round %d: taco: no global delta (model version %d, last model seen %d); no correction this round",
            facts.round,
            facts.model_version,
            self.prev_version,
        )
        return None

    def begin_round(self, ctx: LocalContext) -> None:
        plan = ctx.plan
        steps = max(1, plan.steps)
        gamma = float(ctx.setting("gamma")) or 1.0 / steps
        coef = tailored(gamma, ctx) if ctx.setting("tailored_correction") else 0.0  # off: plain SGD (Table VI)
        coef /= DELTA_SCALE[ctx.setting("correction")](steps, plan.lr)
        step = self.global_step(ctx) if coef else None  # coefficient 0: nothing to correct with
        self.corr = None if step is None else step.mul(coef)
        self.prev_weights, self.prev_version = ctx.start.numpy().copy(), int(ctx.facts.model_version)

    def correct(self, ctx: LocalContext, step: int, xb: torch.Tensor, yb: torch.Tensor) -> None:
        if self.corr is not None:
            ctx.flat.grad.add_(self.corr)  # eq. 8

    def end_round(self, ctx: LocalContext, delta: np.ndarray) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        self.corr = None
        return {}, {}

    def state_dict(self) -> dict[str, np.ndarray]:
        if self.prev_weights is None:
            return {}
        return {"prev_weights": self.prev_weights, "prev_version": np.array(self.prev_version, dtype=np.int64)}

    def load_state_dict(self, state: dict[str, np.ndarray]) -> None:
        if "prev_weights" in state and "prev_version" in state:
            self.prev_weights = np.array(state["prev_weights"], dtype=np.float32)
            self.prev_version = int(state["prev_version"])
