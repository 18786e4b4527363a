"""A model whose trainable parameters and gradients live in two contiguous float32 vectors.

Every algorithm's correction is a vector expression over all parameters (``zeta * (w - w_t)``, ``c - c_i``, a
constant TACO term). With the parameters and gradients as views into one buffer each, a correction is one or two
vector operations per local step instead of a Python loop over tensors, and the SGD step itself is one ``add_``.
Autograd accumulates into existing ``.grad`` tensors in place, so backward writes straight into ``grad``.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from edge_client.learning.models import set_flat
from edge_client.learning.tasks import TASKS, LossFn, task_loss


class FlatModel:
    def __init__(self, module: nn.Module, loss_fn: LossFn | None = None) -> None:
        self.module = module
        trainable = [p for p in module.parameters() if p.requires_grad]
        size = sum(p.numel() for p in trainable)
        self.params = torch.empty(size, dtype=torch.float32)
        self.grad = torch.zeros(size, dtype=torch.float32)
        offset = 0
        with torch.no_grad():
            for p in trainable:
                n = p.numel()
                self.params[offset : offset + n].copy_(p.detach().reshape(-1))
                p.data = self.params[offset : offset + n].view_as(p)
                p.grad = self.grad[offset : offset + n].view_as(p)
                offset += n
        #: the task's loss (``edge_client.learning.tasks.task_loss``); without one, classification's
        self.loss_fn = loss_fn or task_loss(module, TASKS["classification"])

    @property
    def size(self) -> int:
        return self.params.numel()

    def load(self, flat: np.ndarray) -> None:
        """Copy a wire vector into the parameters (length-checked)."""
        set_flat(self.module, flat)

    def numpy(self) -> np.ndarray:
        """A copy of the parameters, safe to keep after further training."""
        return self.params.numpy().copy()

    def loss_and_grad(self, xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
        """Mean mini-batch loss at the current parameters; its gradient replaces ``grad``."""
        self.grad.zero_()
        loss = self.loss_fn(self.module(xb), yb)
        loss.backward()
        return loss.detach()

    def full_gradient(self, x: np.ndarray, y: np.ndarray, out: torch.Tensor, batch_size: int = 1024) -> float:
        """Gradient of the mean loss over all of ``(x, y)`` into ``out``; returns that mean loss.

        Processed in batches (each batch's mean-loss gradient weighted by its share of the samples), so memory stays
        at one batch whatever the data size.
        """
        out.zero_()
        total, n = 0.0, len(y)
        for start in range(0, n, batch_size):
            xb = torch.from_numpy(x[start : start + batch_size])
            yb = torch.from_numpy(y[start : start + batch_size])
            share = len(yb) / n
            total += float(self.loss_and_grad(xb, yb)) * share
            out.add_(self.grad, alpha=share)
        return total
