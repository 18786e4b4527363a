"""Test-set evaluation of a flat weight vector, with one model instance reused across rounds, and the worker thread
that evaluates each round's model while the clients train the next one."""

from __future__ import annotations

import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
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


@dataclass
class Evaluation:
    """A model's test-set figures, and those of the strategy's other outputs by name (TACO's z)."""

    accuracy: float
    loss: float
    outputs: dict[str, tuple[float, float]]
    eval_s: float  # wall clock (time.monotonic) the evaluation took on its thread


def eval_threads() -> int:
    """Torch threads for evaluating beside the clients: half the cores, so a small server is not starved."""
    return max(1, (os.cpu_count() or 1) // 2)


class EvaluationWorker:
    """Evaluates each round's model on a thread of its own while the next round trains, so the round's time does not
    include it. One thread runs the evaluations in submission order; the evaluator's model is used by it alone."""

    def __init__(self, evaluator: Evaluator, threads: int | None = None) -> None:
        self.evaluator = evaluator
        self._pool = ThreadPoolExecutor(
            1, "edgefl-eval", initializer=torch.set_num_threads, initargs=(threads or eval_threads(),)
        )

    def submit(self, weights: np.ndarray, outputs: dict[str, np.ndarray]) -> Future[Evaluation]:
        """Evaluate ``weights`` and ``outputs`` (arrays that the round loop no longer changes)."""
        return self._pool.submit(self._evaluate, weights, outputs)

    def _evaluate(self, weights: np.ndarray, outputs: dict[str, np.ndarray]) -> Evaluation:
        t0 = time.monotonic()
        accuracy, loss = self.evaluator(weights)
        others = {name: self.evaluator(w) for name, w in outputs.items()}
        return Evaluation(accuracy, loss, others, time.monotonic() - t0)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
