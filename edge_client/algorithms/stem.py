"""STEM client half (ALGORITHMS.md 2.5, TACO Algorithm 1 line 11): the momentum-corrected direction
``v_k = g_k + (1 - alpha_t) (v_{k-1} - grad f_i(w_{k-1}; xi_k))``.

The bracketed gradient is taken at the PREVIOUS iterate ``w_{k-1}`` on the SAME mini-batch ``xi_k`` as ``g_k``. That
second forward/backward pass is inherent to STEM ((g): "two gradient computations"); it runs on a twin model (a deep
copy of the client's module wrapped in a FlatModel, made once and reused while the model stays the same) whose flat
parameters hold ``w_{k-1}``, so the real model's gradient buffer and BatchNorm statistics are untouched (C6). The
trainer then steps along ``v`` (``grad := v``). The upload adds ``v_{K-1}`` as ``arrays["v"]``.

Step 0 ((f)1): ``init = "grad"`` (default, [RECOMMENDED]) uses ``v_0 = g_0``; ``init = "server_avg"`` takes
``v_{-1} := v_bar`` (the server's average of last round's ``v``, ``arrays["v_bar"]``) and ``w_{-1} := w_t = w_0``,
so the second gradient equals ``g_0`` and ``v_0 = alpha_t g_0 + (1 - alpha_t) v_bar`` without a second pass; without
``v_bar`` (round 1, (f)5) it falls back to ``"grad"``. No state is kept across rounds.
"""

from __future__ import annotations

import copy

import numpy as np
import torch

from edge_client.algorithms.base import ClientAlgorithm, LocalContext
from edge_client.algorithms.contract import Array, Contract, Setting, weighting
from edge_client.learning.flat import FlatModel

CONTRACT = Contract(
    "stem",
    "STEM: clients step along a two-gradient momentum v; the server adds the mean v to the average",
    settings=(
        Setting("alpha", float, 0.2, "alpha_t, momentum parameter of the client recursion (constant, 2.5 (f)2)",
                low=0.0, high=1.0, device=True),
        Setting("server_v_coeff", float, 1.0, "multiplies mean_i v_i in the server rule (1.0 = literal, 2.5 (f)3)"),
        Setting("init", str, "grad", "step-0 direction: v_0 = g_0 ('grad') or from the server's v_bar "
                "('server_avg')", choices=("grad", "server_avg"), device=True),
        weighting("uniform"),
    ),
    sends=(Array("v_bar", "the weighted mean of last round's v_i (init = 'server_avg')", required=False,
                 scope="global"),),
    returns=(Array("v", "v_{K-1}, the last momentum direction", codec="half", summed="weighted"),),
    needs="sums",
    dp_refusal="", dp_requires=(("weighting", "uniform"),),
    buffered=False,
    buffered_why=(
        "the server's momentum v combines the round's momenta of devices that all started from one model; stale "
        "momenta of older models would be mixed into it uncorrected"
    ),
)  # fmt: skip


class StemClient(ClientAlgorithm):
    contract = CONTRACT

    def __init__(self) -> None:
        self._twin: FlatModel | None = None  # params hold w_{k-1}
        self._twin_of: torch.nn.Module | None = None
        self._v: torch.Tensor | None = None
        self._decay = 0.8  # 1 - alpha_t, set per round
        self._v_bar: torch.Tensor | None = None

    def _twin_for(self, flat: FlatModel) -> FlatModel:
        twin = self._twin
        if twin is None or self._twin_of is not flat.module or twin.size != flat.size:
            twin = self._twin = FlatModel(copy.deepcopy(flat.module), flat.loss_fn)  # the task's loss too
            self._twin_of = flat.module
        twin.module.train(flat.module.training)
        return twin

    def begin_round(self, ctx: LocalContext) -> None:
        self._decay = 1.0 - float(ctx.setting("alpha"))
        self._twin_for(ctx.flat)
        if self._v is None or self._v.numel() != ctx.flat.size:
            self._v = torch.zeros_like(ctx.flat.params)
        self._v.zero_()
        self._v_bar = None
        if ctx.setting("init") == "server_avg" and ctx.has_array("v_bar"):
            self._v_bar = ctx.array("v_bar")

    def correct(self, ctx: LocalContext, step: int, xb: torch.Tensor, yb: torch.Tensor) -> None:
        assert self._twin is not None and self._v is not None
        flat, twin, v = ctx.flat, self._twin, self._v
        if step == 0:
            if self._v_bar is None:
                v.copy_(flat.grad)  # v_0 = g_0
            else:  # v_0 = g_0 + (1 - a)(v_bar - g_0) = a g_0 + (1 - a) v_bar
                v.copy_(flat.grad).mul_(1.0 - self._decay).add_(self._v_bar, alpha=self._decay)
        else:
            twin.loss_and_grad(xb, yb)  # h = grad f_i(w_{k-1}; xi_k) into twin.grad
            v.sub_(twin.grad).mul_(self._decay).add_(flat.grad)  # v = g + (1 - a)(v - h)
        twin.params.copy_(flat.params)  # w_k becomes the previous iterate of step k + 1
        flat.grad.copy_(v)  # the trainer steps along v

    def end_round(self, ctx: LocalContext, delta: np.ndarray) -> tuple[dict[str, float], dict[str, np.ndarray]]:
        assert self._v is not None
        return {}, {"v": self._v.numpy().copy()}  # v_{K-1} (zeros if no step ran)
