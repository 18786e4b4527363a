"""Test-set evaluation of a flat weight vector, with one model instance reused across rounds."""

from __future__ import annotations

from typing import Any

import numpy as np

from edge_client.data import ArrayDataset
from edge_client.models import build_model, set_flat
from edge_client.tasks import TASKS, Task, evaluate


class Evaluator:
    """The task's loss and metrics on the server's test set, with the model's own rules, as it was trained."""

    def __init__(
        self,
        model_spec: dict[str, Any],
        test: ArrayDataset,
        task: Task = TASKS["classification"],
        batch_size: int = 1000,
    ) -> None:
        self.model = build_model(model_spec)
        self.task = task
        self.test = test
        self.batch_size = batch_size

    def __call__(self, weights: np.ndarray) -> dict[str, float]:
        """``{"loss": ..., <metric>: ...}`` of ``weights`` on the held-out test set (``edge_client.tasks.evaluate``)."""
        set_flat(self.model, weights)
        return evaluate(self.model, self.task, self.test, self.batch_size)
