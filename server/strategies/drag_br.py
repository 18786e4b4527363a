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

Streaming: the reference depends only on ``theta^t``, so ``begin`` trains it while the clients train, and each update
is folded on arrival as ``sum_m (1 - lambda_m)(|r| / |g_m|) g_m`` (one vector) and the scalar ``sum_m lambda_m``;
``finish`` forms ``Delta = (that sum + that scalar r) / S``. One model-sized vector besides ``r``, whatever the number
of clients.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from edge_client.algorithms.drag_br import CONTRACT, PAPER_ROOT_SIZE
from edge_client.algorithms.fedavg import FedAvgClient
from edge_client.learning.data import BatchSampler
from edge_client.learning.flat import FlatModel
from edge_client.learning.models import build_model
from edge_client.learning.tasks import task_loss
from edge_client.loop.trainer import train_local
from edge_client.wire.messages import Update
from edge_client.wire.plan import Plan
from server.strategies.base import Round, ServerContext, Strategy, TrainSettings
from server.strategies.common import EPS, axpy
from server.strategies.drag import DragRound, degree_of_divergence, increment_cosine

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

    def begin(self, round_: int, weights: np.ndarray) -> Round:
        r = self.reference(round_, weights)
        g_sum = np.zeros(weights.size, dtype=np.float32)
        return DragRound(round_, weights, r=r, r_norm=float(np.linalg.norm(r)), g_sum=g_sum)

    def add(self, rnd: Round, update: Update) -> None:
        assert isinstance(rnd, DragRound) and rnd.r is not None
        g_norm = rnd.delta_norm(update)
        cos = increment_cosine(update.delta, g_norm, rnd.r, rnd.r_norm)
        lam = degree_of_divergence(cos, self.params["c"], self.params["angle_approx"])  # eq. 10 against the root
        rnd.lambdas[update.client_id] = lam
        if g_norm >= EPS:  # eq. 14, first term (skipped for a zero update, C5); g = -delta
            rnd.g_sum = axpy(rnd.g_sum, update.delta, -(1.0 - lam) * rnd.r_norm / g_norm)
        rnd.r_coef += lam  # eq. 14, second term's coefficient

    def close(self, rnd: Round) -> np.ndarray:
        assert isinstance(rnd, DragRound)
        self._r_norm = rnd.r_norm
        self._lambdas = rnd.lambdas
        return (rnd.weights + rnd.delta()).astype(np.float32, copy=False)  # theta^{t+1} = theta^t + Delta^t ((f)1)

    def round_metrics(self) -> dict[str, Any]:
        return {"lambda": dict(self._lambdas), "r_norm": self._r_norm}
