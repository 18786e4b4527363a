"""The local optimisation loop: exactly ``local_steps`` SGD steps, timed on their own.

Wall time (``perf_counter``) and process CPU time (``process_time``, which sums torch's threads) cover the loop only:
loading weights, serialising and communicating are timed elsewhere (RESEARCH.md section 3, plato PR #92).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from edge_client.algorithms.base import ClientAlgorithm
from edge_client.data import ArrayDataset, BatchSampler
from edge_client.models import get_flat, set_flat
from edge_client.protocol import Assignment


@dataclass
class TrainResult:
    delta: np.ndarray  # w_start - w_end (descent-positive)
    local_steps: int
    compute_s: float
    cpu_s: float
    train_loss: float


def prepare_process(threads: int) -> None:
    """Fix torch's thread pools and pay torch's lazy imports once, before the first round.

    Fixed threads keep compute times comparable between rounds; the first ``torch.optim`` optimiser costs seconds
    of imports, which would otherwise delay round 1 on every device.
    """
    torch.set_num_threads(max(1, threads))
    with contextlib.suppress(RuntimeError):  # already set, or parallel work already ran in this process
        torch.set_num_interop_threads(1)
    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)


def train_local(
    model: nn.Module,
    dataset: ArrayDataset,
    sampler: BatchSampler,
    assignment: Assignment,
    algorithm: ClientAlgorithm,
) -> TrainResult:
    """Run the assignment's local steps from its global weights and return the update."""
    set_flat(model, assignment.weights)
    start = get_flat(model)
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=assignment.lr)
    algorithm.begin_round(model, assignment)
    x, y = dataset.x, dataset.y
    loss_sum = torch.zeros(())

    wall0, cpu0 = time.perf_counter(), time.process_time()
    for step in range(assignment.local_steps):
        idx = sampler.next()
        xb, yb = torch.from_numpy(x[idx]), torch.from_numpy(y[idx])
        optimizer.zero_grad(set_to_none=False)
        loss = F.cross_entropy(model(xb), yb)
        loss.backward()
        algorithm.correct(model, step)
        optimizer.step()
        loss_sum += loss.detach()
    compute_s, cpu_s = time.perf_counter() - wall0, time.process_time() - cpu0

    return TrainResult(
        delta=start - get_flat(model),
        local_steps=assignment.local_steps,
        compute_s=compute_s,
        cpu_s=cpu_s,
        train_loss=float(loss_sum) / max(1, assignment.local_steps),
    )
