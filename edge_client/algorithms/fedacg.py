"""FedACG client half (ALGORITHMS.md 2.6 [RECOMMENDED] "original" mode; Kim, Kim, Han, CVPR 2024).

The server sends the look-ahead model ``w_hat_t = w_t - lambda_acg m_t`` as the weights to start from; the client runs
SGD on ``f_i(w) + (beta/2)||w - w_hat_t||^2`` (the prox gradient ``beta (w - w_hat_t)`` added analytically) and
uploads ``delta = w_hat_t - w_K`` (descent-positive, relative to what it received).

In the server's ``taco_literal`` mode the client starts from ``w_t`` and the prox centre ``w_hat_t`` arrives as the
array ``centre`` (2.6 (f)); without that array the centre is the received model.
"""

from __future__ import annotations

import torch

from edge_client.algorithms.base import LocalContext
from edge_client.algorithms.fedprox import FedProxClient


class FedACGClient(FedProxClient):
    """FedProx's analytic prox step with coefficient ``beta`` and the look-ahead as centre; no state across rounds."""

    name = "fedacg"
    coefficient_name = "beta"

    def centre(self, ctx: LocalContext) -> torch.Tensor:
        if "centre" in ctx.assignment.arrays:
            centre = ctx.array("centre")
            if centre.shape != ctx.start.shape:
                raise ValueError(f"fedacg: centre has shape {tuple(centre.shape)}, the model {tuple(ctx.start.shape)}")
            return centre
        return ctx.start
