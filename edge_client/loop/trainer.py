"""The local optimisation loop: exactly the plan's ``steps`` SGD steps, timed on their own.

Wall time (``perf_counter``) and process CPU time (``process_time``, which sums torch's threads) cover the local
computation only, the algorithm's own work included (FedVeca's local gradient, STEM's second gradient); loading
weights, serialising and communicating are timed elsewhere (RESEARCH.md section 3, plato PR #92). The part of it
outside the steps (the algorithm's ``begin_round`` and ``end_round``: a fixed cost per round) is also timed apart as
``overhead_s``, so the server predicts a round as overhead + steps x seconds per step: dividing all of it by the steps
made FedVeca's steps look many times dearer than they are.

The local optimiser is plain SGD (ALGORITHMS.md C7), with the run's ``momentum`` and ``weight_decay`` when set
(FedUmf's paper uses 0.5 and 5e-4); the momentum buffer is reset every round. ``train_local`` takes the
:class:`~edge_client.wire.plan.Plan` a strategy made and the round's facts as the assignment carried them, not a network
message, so the server's own training (DRAG-BR's root reference) and the device benchmark run the same loop as a
device.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from edge_client.algorithms.base import ClientAlgorithm, LocalContext
from edge_client.learning.data import ArrayDataset, BatchSampler
from edge_client.learning.flat import FlatModel
from edge_client.loop.dp import privatize
from edge_client.wire.messages import RoundFacts
from edge_client.wire.plan import Plan

#: The facts of a round trained without a server (the server's own training, a benchmark): round 0, model version 0.
NO_FACTS = RoundFacts()


@dataclass
class TrainResult:
    delta: np.ndarray  # w_t - w_end (descent-positive)
    local_steps: int
    compute_s: float
    cpu_s: float
    train_loss: float
    overhead_s: float = 0.0  # of compute_s: begin_round and end_round (wall)
    overhead_cpu_s: float = 0.0  # of cpu_s: the same work's process CPU seconds
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
    (probe * 2).sum().backward()  # not torch.optim: the loop never uses it, and it imports torch._dynamo (69 MiB)


def train_local(
    flat: FlatModel,
    weights: np.ndarray,
    dataset: ArrayDataset,
    sampler: BatchSampler,
    plan: Plan,
    algorithm: ClientAlgorithm,
    facts: RoundFacts = NO_FACTS,
) -> TrainResult:
    """Run the plan's local steps from ``weights`` and return the update."""
    flat.load(weights)
    flat.module.train()
    ctx = LocalContext(flat, flat.params.clone(), plan, facts, dataset, sampler)
    lr, momentum, weight_decay = plan.lr, plan.momentum, plan.weight_decay
    buf = torch.zeros_like(flat.params) if momentum else None
    x, y = dataset.x, dataset.y
    loss_sum = torch.zeros(())

    wall0, cpu0 = time.perf_counter(), time.process_time()
    algorithm.begin_round(ctx)
    loop_wall, loop_cpu = time.perf_counter(), time.process_time()
    for step in range(plan.steps):
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
    loop_wall, loop_cpu = time.perf_counter() - loop_wall, time.process_time() - loop_cpu
    delta = (ctx.start - flat.params).numpy()
    extras, arrays = algorithm.end_round(ctx, delta)
    delta, arrays, private = privatize(plan.settings, delta, arrays)  # before any codec (edge_client.loop.dp)
    compute_s, cpu_s = time.perf_counter() - wall0, time.process_time() - cpu0

    return TrainResult(
        delta=delta,
        local_steps=plan.steps,
        compute_s=compute_s,
        cpu_s=cpu_s,
        train_loss=float(loss_sum) / max(1, plan.steps),
        overhead_s=max(0.0, compute_s - loop_wall),
        overhead_cpu_s=max(0.0, cpu_s - loop_cpu),
        extras={**extras, **private},
        arrays=arrays,
    )
