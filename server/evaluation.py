"""Test-set evaluation of a flat weight vector, with one model instance reused across rounds."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from edge_client.data import ArrayDataset
from edge_client.models import build_model, set_flat


class Evaluator:
    def __init__(self, model_spec: dict[str, Any], test: ArrayDataset, batch_size: int = 1000) -> None:
        self.model = build_model(model_spec)
        self.x = torch.from_numpy(test.x)
        self.y = torch.from_numpy(test.y)
        self.batch_size = batch_size

    @torch.no_grad()
    def __call__(self, weights: np.ndarray) -> tuple[float, float]:
        """(accuracy, mean cross-entropy loss) of ``weights`` on the held-out test set."""
        set_flat(self.model, weights)
        self.model.eval()
        correct, loss = 0, 0.0
        for start in range(0, len(self.y), self.batch_size):
            xb, yb = self.x[start : start + self.batch_size], self.y[start : start + self.batch_size]
            logits = self.model(xb)
            loss += float(F.cross_entropy(logits, yb, reduction="sum"))
            correct += int((logits.argmax(1) == yb).sum())
        return correct / len(self.y), loss / len(self.y)
