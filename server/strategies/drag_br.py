"""DRAG-BR, DRAG's Byzantine-robust variant (ALGORITHMS.md 2.8 (b) "Byzantine variant", eq. 8, 10, 12-14).

Works in DRAG's increment convention like ``server.strategies.drag`` (``g_m = -delta_m``; ``theta_{t+1} = theta_t +
Delta``, (f)1). Each round the server trains a copy of ``theta^t`` for U plain SGD steps on its own root data set
(eq. 12, the clients' ``eta``, ``B``, ``U`` — (f)8) and takes ``r^t = theta^{t,U} - theta^t`` (eq. 13, no momentum
recursion) as the trusted reference. Each update is then re-scaled to ``|r|`` and dragged toward ``r``:
``v_m = (1 - lambda_m)(|r| / |g_m|) g_m + lambda_m r`` (eq. 14), so with ``lambda_m`` in ``[0, 1]`` no upload, however
scaled, moves the model by more than ``|r|``.

Degenerate norms ((f)5, C5): ``|g_m| = 0`` gives ``v_m = lambda_m r`` with ``lambda_m = c`` (cos := 0); ``|r| = 0`` is
left to eq. 14 (``v_m = lambda_m r = 0``: no trusted direction, the model stays) rather than falling back to the
untrusted ``g_m`` as the normal variant does.

The root batches come from ``BatchSampler(len(root), B, seed, "drag-br-root/<round>")``: a fixed, per-round stream,
so a restarted server recomputes the same reference without keeping sampler state.
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np
import torch

from edge_client.data import BatchSampler
from edge_client.flat import FlatModel
from edge_client.models import build_model
from edge_client.protocol import Update
from server.strategies.base import ServerContext, Strategy, TrainSettings
from server.strategies.common import EPS, cosine
from server.strategies.drag import ANGLE_APPROX, check_fraction, degree_of_divergence


class DragBR(Strategy):
    """DRAG-BR with a root-data reference.

    Defaults: ``c = 0.1`` (the paper gives no ``c`` for its Byzantine runs; (f)7 [RECOMMENDED] reuses the clean
    CIFAR-10 value — note a fully reversed update is mapped to ``(4c - 1) r``, so neutralising direction-reversal
    attacks needs ``c >= 1/4``), ``root_size = 3000`` (``N_root``, 2.8 (d)).
    """

    name = "drag-br"
    description = "FedAvg clients; the server re-scales and drags each update toward a reference trained on root data"
    defaults: ClassVar[dict[str, Any]] = {"c": 0.1, "angle_approx": "linear_pi_over_2", "root_size": 3000}
    choices: ClassVar[dict[str, tuple[Any, ...]]] = {"angle_approx": ANGLE_APPROX}

    def __init__(self, settings: TrainSettings, params: dict[str, Any] | None = None, seed: int = 0) -> None:
        super().__init__(settings, params, seed)
        check_fraction(self.name, "c", self.params["c"])
        if self.params["root_size"] < 1:
            raise ValueError(
                f"{self.name}.root_size must be a positive number of samples; got {self.params['root_size']}"
            )
        self.flat: FlatModel | None = None
        self._lambdas: dict[str, float] = {}
        self._r_norm = 0.0

    def root_size(self) -> int:
        return int(self.params["root_size"])

    def setup(self, ctx: ServerContext) -> None:
        super().setup(ctx)
        if ctx.root is None or len(ctx.root) == 0:
            raise ValueError(
                f"{self.name} needs a server-side root data set; set [algorithm.{self.name}] root_size = <samples> "
                f"(default {self.defaults['root_size']}) so the server keeps that many training samples"
            )
        self.flat = FlatModel(build_model(ctx.model_spec))
        if ctx.num_params and self.flat.size != ctx.num_params:
            raise ValueError(f"{self.name}: model spec has {self.flat.size} parameters, the run has {ctx.num_params}")

    def root_sampler(self, round_: int) -> BatchSampler:
        """The root batches of ``round_`` (fixed seed, one stream per round)."""
        if self.ctx.root is None:
            raise RuntimeError(f"{self.name}: no root data set (setup() was not run with one)")
        return BatchSampler(len(self.ctx.root), self.settings.batch_size, self.ctx.seed, f"drag-br-root/{round_}")

    def reference(self, round_: int, weights: np.ndarray) -> np.ndarray:
        """``r^t = theta^{t,U} - theta^t`` after U plain SGD steps on the root data from ``weights`` (eq. 12-13)."""
        if self.flat is None or self.ctx.root is None:
            raise RuntimeError(f"{self.name}: setup() with a root data set must run before aggregate()")
        flat, root = self.flat, self.ctx.root
        sampler = self.root_sampler(round_)
        flat.load(weights)
        flat.module.train()
        for _ in range(self.settings.local_steps):
            idx = sampler.next()
            flat.loss_and_grad(torch.from_numpy(root.x[idx]), torch.from_numpy(root.y[idx]))
            flat.params.add_(flat.grad, alpha=-self.settings.lr)
        return flat.numpy() - np.asarray(weights, dtype=np.float32)

    def aggregate(self, round_: int, weights: np.ndarray, updates: list[Update]) -> np.ndarray:
        r = self.reference(round_, weights)
        r_norm = float(np.linalg.norm(r))
        self._r_norm = r_norm
        c, approx = self.params["c"], self.params["angle_approx"]
        agg = np.zeros_like(weights, dtype=np.float32)  # Delta^t = (1/S) sum v_m (eq. 8), one update at a time
        self._lambdas = {}
        for u in updates:
            g = np.negative(u.delta, dtype=np.float32)
            lam = degree_of_divergence(cosine(g, r), c, approx)  # eq. 10 against the root reference
            self._lambdas[u.client_id] = lam
            g_norm = float(np.linalg.norm(g))
            if g_norm >= EPS:  # eq. 14, first term (skipped for a zero update, C5)
                agg += g * np.float32((1.0 - lam) * r_norm / g_norm / len(updates))
            agg += r * np.float32(lam / len(updates))  # eq. 14, second term
        return (weights + agg).astype(np.float32)  # theta^{t+1} = theta^t + Delta^t ((f)1)

    def round_metrics(self) -> dict[str, Any]:
        return {"lambda": dict(self._lambdas), "r_norm": self._r_norm}
