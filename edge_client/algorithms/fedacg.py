"""FedACG client half (ALGORITHMS.md 2.6 [RECOMMENDED] "original" mode; Kim, Kim, Han, CVPR 2024).

The server sends the look-ahead model ``w_hat_t = w_t - lambda_acg m_t`` as the weights to start from; the client runs
SGD on ``f_i(w) + (beta/2)||w - w_hat_t||^2`` (the prox gradient ``beta (w - w_hat_t)`` added analytically) and
uploads ``delta = w_hat_t - w_K`` (descent-positive, relative to what it received).

In the server's ``taco_literal`` mode the client starts from ``w_t`` and the prox centre ``w_hat_t`` arrives as the
array ``centre`` (2.6 (f)); without that array the centre is the received model. ``lambda_acg`` is
``server_momentum`` (0.85 [EXTERNAL], not in TACO), ``beta`` the prox coefficient (0.001, TACO).
"""

from __future__ import annotations

import torch

from edge_client.algorithms.base import LocalContext
from edge_client.algorithms.contract import Array, Contract, Setting, weighting
from edge_client.algorithms.fedprox import FedProxClient

CONTRACT = Contract(
    "fedacg",
    "server momentum with a look-ahead model that clients start from and stay close to (prox beta)",
    settings=(
        Setting("beta", float, 0.001, "prox coefficient towards the look-ahead model", low=0.0, device=True),
        Setting("server_momentum", float, 0.85, "lambda: momentum of the server's m", low=0.0, high=1.0,
                high_open=True),
        weighting("samples"),
        Setting("mode", str, "original", "clients start from the look-ahead ('original') or from w_t with the "
                "look-ahead as prox centre ('taco_literal')", choices=("original", "taco_literal")),
        Setting("include_K", bool, False, "taco_literal: drop the missing K of line 22 (K' = 1)"),
    ),
    sends=(Array("centre", "the look-ahead model as prox centre (taco_literal mode)", required=False,
                 scope="global"),),
    dp_refusal="", dp_requires=(("weighting", "uniform"),),
    buffered=False,
    buffered_why=(
        "every device of a round starts from one look-ahead model w - lambda m; the server momentum m assumes all "
        "deltas are from that look-ahead, which a stale update is not"
    ),
)  # fmt: skip


class FedACGClient(FedProxClient):
    """FedProx's analytic prox step with coefficient ``beta`` and the look-ahead as centre; no state across rounds."""

    contract = CONTRACT

    def coefficient(self, ctx: LocalContext) -> float:
        return float(ctx.setting("beta"))

    def centre(self, ctx: LocalContext) -> torch.Tensor:
        return ctx.array("centre") if ctx.has_array("centre") else ctx.start
