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

from edge_client.learning.data import ArrayDataset
from edge_client.learning.models import build_model, set_flat
from edge_client.learning.tasks import TASKS, Task, evaluate


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
        """``{"loss": ..., <metric>: ...}`` of ``weights`` on the held-out test set
        (``edge_client.learning.tasks.evaluate``)."""
        set_flat(self.model, weights)
        return evaluate(self.model, self.task, self.test, self.batch_size)


@dataclass
class TestResult:
    """A model's test-set figures (``{"loss": ..., <metric>: ...}``), and those of the strategy's other outputs by
    name (TACO's z)."""

    tested: dict[str, float]
    outputs: dict[str, dict[str, float]]
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

    def submit(self, weights: np.ndarray, outputs: dict[str, np.ndarray]) -> Future[TestResult]:
        """Evaluate ``weights`` and ``outputs`` (arrays that the round loop no longer changes)."""
        return self._pool.submit(self._evaluate, weights, outputs)

    def _evaluate(self, weights: np.ndarray, outputs: dict[str, np.ndarray]) -> TestResult:
        t0 = time.monotonic()
        tested = self.evaluator(weights)
        others = {name: self.evaluator(w) for name, w in outputs.items()}
        return TestResult(tested, others, time.monotonic() - t0)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
