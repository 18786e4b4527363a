"""The local optimisation loop: exactly ``local_steps`` SGD steps, timed on their own.

Wall time (``perf_counter``) and process CPU time (``process_time``, which sums torch's threads) cover the local
computation only, the algorithm's own work included (FedVeca's full local gradient, STEM's second gradient); loading
weights, serialising and communicating are timed elsewhere (RESEARCH.md section 3, plato PR #92).

The local optimiser is plain SGD (ALGORITHMS.md C7); an assignment may ask for ``momentum`` and ``weight_decay``
(FedUmf's local optimiser), with the momentum buffer reset every round.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from edge_client.algorithms.base import ClientAlgorithm, LocalContext
from edge_client.data import ArrayDataset, BatchSampler
from edge_client.flat import FlatModel
from edge_client.protocol import Assignment


@dataclass
class TrainResult:
    delta: np.ndarray  # w_t - w_end (descent-positive)
    local_steps: int
    compute_s: float
    cpu_s: float
    train_loss: float
    extras: dict[str, Any] = field(default_factory=dict)
    arrays: dict[str, np.ndarray] = field(default_factory=dict)


def prepare_process(threads: int) -> None:
    """Fix torch's thread pools and pay torch's lazy imports once, before the first round.

    Fixed threads keep compute times comparable between rounds; the first autograd call costs seconds of imports,
    which would otherwise delay round 1 on every device.
    """
    torch.set_num_threads(max(1, threads))
    with contextlib.suppress(RuntimeError):  # already set, or parallel work already ran in this process
        torch.set_num_interop_threads(1)
    probe = torch.zeros(1, requires_grad=True)
    (probe * 2).sum().backward()
    torch.optim.SGD([probe], lr=0.1)


def train_local(
    flat: FlatModel,
    dataset: ArrayDataset,
    sampler: BatchSampler,
    assignment: Assignment,
    algorithm: ClientAlgorithm,
) -> TrainResult:
    """Run the assignment's local steps from its global weights and return the update."""
    flat.load(assignment.weights)
    flat.module.train()
    ctx = LocalContext(flat, flat.params.clone(), assignment, dataset, sampler)
    lr = assignment.lr
    momentum = float(assignment.params.get("momentum", 0.0))
    weight_decay = float(assignment.params.get("weight_decay", 0.0))
    buf = torch.zeros_like(flat.params) if momentum else None
    x, y = dataset.x, dataset.y
    loss_sum = torch.zeros(())

    wall0, cpu0 = time.perf_counter(), time.process_time()
    algorithm.begin_round(ctx)
    for step in range(assignment.local_steps):
        idx = sampler.next()
        xb, yb = torch.from_numpy(x[idx]), torch.from_numpy(y[idx])
        loss_sum += flat.loss_and_grad(xb, yb)
        algorithm.correct(ctx, step, xb, yb)
        direction = flat.grad
        if weight_decay:
            direction.add_(flat.params, alpha=weight_decay)
        if buf is not None:
            direction = buf.mul_(momentum).add_(direction)
        flat.params.add_(direction, alpha=-lr)
    delta = (ctx.start - flat.params).numpy()
    extras, arrays = algorithm.end_round(ctx, delta)
    compute_s, cpu_s = time.perf_counter() - wall0, time.process_time() - cpu0

    return TrainResult(
        delta=delta,
        local_steps=assignment.local_steps,
        compute_s=compute_s,
        cpu_s=cpu_s,
        train_loss=float(loss_sum) / max(1, assignment.local_steps),
        extras=extras,
        arrays=arrays,
    )
