"""FedUmf client half (ALGORITHMS.md 2.9): train every round, keep the increment, fuse it when re-authorised.

Every client trains from the global model each round (selected or not) and stores its *increment*
``g = w_end - w_start`` (the paper's ``g_t^i = theta_{t+1}^i - theta_{t,0}^i``, the negative of edgefl's
descent-positive delta, C1), tagged with the round it was computed in and whether the client uploaded in that round.
A client selected now (``facts.upload``) that was NOT selected in round ``t-1`` and holds the increment of round
``t-1`` (staleness guard, (f)3) first moves its start point to ``w_t + alpha * (eta_t / eta_{t-1}) * g`` (step 3 of
the paper). The trainer measures ``delta = w_t - w_end`` against the received ``w_t`` (``ctx.start``), so a fused
client's delta contains the fused increment, exactly as the paper's uploaded ``theta_{t+1}^i`` does (2.9 (e)).

Round 1 is a no-op (no stored increment, (f)4); the increment stored after a fused round starts at the fused point
((f)6). Momentum/weight decay are the run's local optimiser (``train.momentum``/``train.weight_decay``, the paper's 0.5
and 5e-4 in its suite), so the increment includes them ((f)7). The stored increment survives a restart through
``state_dict`` (the runtime saves it after every round)."""

from __future__ import annotations

import logging

import numpy as np
import torch

from edge_client.algorithms.base import ClientAlgorithm, LocalContext
from edge_client.algorithms.contract import Contract, Setting, Value, weighting

log = logging.getLogger("edgefl.client")

CONTRACT = Contract(
    "fedumf",
    "partial participation; unselected clients train too and fuse their stored update when selected",
    settings=(
        Setting("alpha", float, 1.0, "fusion coefficient (0 switches fusion off, an ablation)", low=0.0, high=1.0,
                device=True),
        Setting("lr_decay", float, 1.0, "eta_t = lr * lr_decay**(t-1)", low=0.0, low_open=True),
        Setting("local_unit", str, "steps", "K counts train.local_steps ('steps') or local epochs ('epochs')",
                choices=("steps", "epochs")),
        Setting("epochs", int, 1, "local epochs when local_unit = 'epochs'", low=1),
        weighting("samples"),
    ),
    sends_values=(Value("lr_prev", "eta_{t-1}, for the fusion factor alpha eta_t / eta_{t-1}", low=0.0,
                        example=0.01),),
    dp_refusal=(
        "it picks a fixed-size sample itself (the rest train without "
        "uploading), not the Poisson sample the accountant counts"
    ),
    buffered=False,
    buffered_why=(
        "its unselected devices train without uploading and fuse that increment when selected in a later round: the "
        "round's split into selected and training-only devices has no meaning when every device is always training"
    ),
)  # fmt: skip


class FedUmfClient(ClientAlgorithm):
    contract = CONTRACT

    def __init__(self) -> None:
        self.stored: torch.Tensor | None = None  # increment g = w_end - w_start of round ``stored_round``
        self.stored_round = 0  # 0: nothing stored (rounds are numbered from 1)
        self.stored_selected = False  # did this client upload in ``stored_round``?
        #: the coefficient ``alpha * eta_t / eta_{t-1}`` applied this round, 0.0 when it did not fuse (diagnostics)
        self.fused_coefficient = 0.0
        self._w0: torch.Tensor | None = None  # the (possibly fused) start point of this round

    def begin_round(self, ctx: LocalContext) -> None:
        t = ctx.facts.round
        selected = bool(ctx.facts.upload)
        self.fused_coefficient = 0.0
        # i in S_t ∩ S_{t-1}^c, with the increment computed in round t-1 (not staler than one round).
        if selected and self.stored is not None and self.stored_round == t - 1 and not self.stored_selected:
            if self.stored.numel() != ctx.flat.size:
                log.warning(
                    "fedumf: stored update has %d values, the model %d; not fused", self.stored.numel(), ctx.flat.size
                )
            else:
                alpha, lr, lr_prev = float(ctx.setting("alpha")), ctx.plan.lr, float(ctx.setting("lr_prev"))
                coefficient = alpha * (lr / lr_prev) if lr_prev > 0 else alpha
                ctx.flat.params.add_(self.stored, alpha=coefficient)
                self.fused_coefficient = coefficient
        if self._w0 is None or self._w0.numel() != ctx.flat.size:
            self._w0 = torch.empty_like(ctx.flat.params)
        self._w0.copy_(ctx.flat.params)

    def end_round(self, ctx: LocalContext, delta: np.ndarray) -> tuple[dict[str, float], dict[str, np.ndarray]]:
        # All clients store g_t = w_end - w_start (the fused start point, (f)6), overwriting the previous one.
        assert self._w0 is not None
        if self.stored is None or self.stored.numel() != ctx.flat.size:
            self.stored = torch.empty_like(ctx.flat.params)
        torch.sub(ctx.flat.params, self._w0, out=self.stored)
        self.stored_round = int(ctx.facts.round)
        self.stored_selected = bool(ctx.facts.upload)
        return {}, {}

    def state_dict(self) -> dict[str, np.ndarray]:
        if self.stored is None:
            return {}
        return {
            "stored": self.stored.numpy().copy(),
            "stored_round": np.array(self.stored_round, dtype=np.int64),
            "stored_selected": np.array(self.stored_selected, dtype=np.bool_),
        }

    def load_state_dict(self, state: dict[str, np.ndarray]) -> None:
        if "stored" not in state:
            self.stored, self.stored_round, self.stored_selected = None, 0, False
            return
        self.stored = torch.from_numpy(np.array(state["stored"], dtype=np.float32).reshape(-1))
        self.stored_round = int(state["stored_round"])
        self.stored_selected = bool(state["stored_selected"])
