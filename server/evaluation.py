"""Test-set evaluation of a flat weight vector, with one model instance reused across rounds."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from edge_client.data import ArrayDataset
from edge_client.models import build_model, loss_function, predict_labels, set_flat


class Evaluator:
    """Accuracy and loss with the model's own rules (``loss_function`` / ``predict_labels``), as it was trained."""

    def __init__(self, model_spec: dict[str, Any], test: ArrayDataset, batch_size: int = 1000) -> None:
        self.model = build_model(model_spec)
        self.loss_fn = loss_function(self.model)
        self.x = torch.from_numpy(test.x)
        self.y = torch.from_numpy(test.y)
        self.batch_size = batch_size

    @torch.no_grad()
    def __call__(self, weights: np.ndarray) -> tuple[float, float]:
        """(accuracy, mean loss) of ``weights`` on the held-out test set; the loss is cross-entropy unless the model
        defines its own (e.g. the SVM's squared hinge)."""
        set_flat(self.model, weights)
        self.model.eval()
        correct, loss = 0, 0.0
        for start in range(0, len(self.y), self.batch_size):
            xb, yb = self.x[start : start + self.batch_size], self.y[start : start + self.batch_size]
            outputs = self.model(xb)
            loss += float(self.loss_fn(outputs, yb)) * len(yb)
            correct += int((predict_labels(self.model, outputs) == yb).sum())
        return correct / len(self.y), loss / len(self.y)
