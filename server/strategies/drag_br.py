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

import logging
from typing import Any

import numpy as np

from edge_client.algorithms.drag_br import CONTRACT, PAPER_ROOT_SIZE
from edge_client.algorithms.fedavg import FedAvgClient
from edge_client.data import BatchSampler
from edge_client.flat import FlatModel
from edge_client.models import build_model
from edge_client.protocol import Update
from edge_client.tasks import task_loss
from edge_client.trainer import Plan, train_local
from server.strategies.base import ServerContext, Strategy, TrainSettings
from server.strategies.common import EPS, cosine
from server.strategies.drag import degree_of_divergence

log = logging.getLogger("edgefl.server")

#: The share of the training set kept as root data when the paper's 3000 samples would take more than it.
ROOT_FRACTION = 0.1


class DragBR(Strategy):
    """DRAG-BR with a root-data reference (``root_size`` 0: the paper's 3000 samples, 2.8 (d), where the training set
    can spare them, else a tenth of it, said in the log)."""

    contract = CONTRACT

    def __init__(self, settings: TrainSettings, params: dict[str, Any] | None = None, seed: int = 0) -> None:
        super().__init__(settings, params, seed)
        self.flat: FlatModel | None = None
        self._lambdas: dict[str, float] = {}
        self._r_norm = 0.0

    def root_size(self, train_size: int) -> int:
        size = self.params["root_size"]
        if size:
            return int(size)
        size = PAPER_ROOT_SIZE if ROOT_FRACTION * train_size >= PAPER_ROOT_SIZE else round(ROOT_FRACTION * train_size)
        log.info("%s: root data set of %d of the %d training samples (root_size = 0: the paper's %d where the data "
                 "allows, else a tenth)", self.name, size, train_size, PAPER_ROOT_SIZE)  # fmt: skip
        return max(1, size)

    def setup(self, ctx: ServerContext) -> None:
        super().setup(ctx)
        if ctx.root is None or len(ctx.root) == 0:
            raise ValueError(f"{self.name}: needs a server-side root data set; the server keeps "
                             f"[algorithm.{self.name}] root_size training samples for it")  # fmt: skip
        module = build_model(ctx.model_spec)
        self.flat = FlatModel(module, task_loss(module, ctx.task))
        if ctx.num_params and self.flat.size != ctx.num_params:
            raise ValueError(f"{self.name}: model spec has {self.flat.size} parameters, the run has {ctx.num_params}")

    def root_sampler(self, round_: int) -> BatchSampler:
        """The root batches of ``round_`` (fixed seed, one stream per round)."""
        if self.ctx.root is None:
            raise RuntimeError(f"{self.name}: no root data set (setup() was not run with one)")
        return BatchSampler(len(self.ctx.root), self.settings.batch_size, self.ctx.seed, f"drag-br-root/{round_}")

    def reference(self, round_: int, weights: np.ndarray) -> np.ndarray:
        """``r^t = theta^{t,U} - theta^t`` after U plain SGD steps on the root data from ``weights`` (eq. 12-13):
        the device's own training loop, with FedAvg's client half and the clients' ``eta``, ``B``, ``U``."""
        if self.flat is None or self.ctx.root is None:
            raise RuntimeError(f"{self.name}: setup() with a root data set must run before aggregate()")
        s = self.settings
        plan = Plan(s.local_steps, s.lr, s.batch_size)
        result = train_local(self.flat, weights, self.ctx.root, self.root_sampler(round_), plan, FedAvgClient())
        return np.negative(result.delta)

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
