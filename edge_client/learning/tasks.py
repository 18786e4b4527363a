"""What a model is trained for: its loss, its metrics and the metric that says how good it is.

A run's task comes from its ``[task]`` section (``name`` = classification | regression | binary, or ``factory`` =
``"package.module:callable"`` returning a :class:`Task`); the server sends it with every assignment and evaluation
request, so training, device evaluation and server evaluation all use the same functions. Every algorithm's client
half corrects gradients, never the loss, so each one works with any task.

Metrics are means over the samples of one split, so the server combines the devices' reports by a sample-weighted
mean (``combine_reports``); a metric that is not such a mean is derived again afterwards (``Task.derive``: RMSE from
the pooled MSE). A binary task's AUC is not a mean: across devices it is the sample-weighted mean of each device's
AUC, an approximation of the pooled AUC that the server's own test set (``[eval] mode = "server"``) computes exactly.

Each task declares the range of its loss and of every metric (``Task.ranges``: accuracy and AUC in [0, 1], losses and
errors >= 0): a device's evaluation report outside them is refused before it is combined (``Task.out_of_range``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from edge_client.learning.data import ArrayDataset
from edge_client.learning.factories import FACTORY_KEY, SERVER, AllowedCode, build_with_factory

__all__ = ["TASKS", "Task", "auc", "build_task", "combine_reports", "evaluate", "predicted_labels", "task_loss"]

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
MetricsFn = Callable[[torch.Tensor, torch.Tensor], dict[str, float]]


@dataclass(frozen=True)
class Task:
    """A task: ``loss(outputs, targets)`` is the mean loss of a batch (differentiable); ``metrics(outputs, targets)``
    the metrics of a whole split, each a mean over its samples unless ``derive`` recomputes it from the combined means;
    ``higher_is_better`` names every metric ``metrics`` returns; ``check_targets`` says what is wrong with a device's
    labels for this task (None when they fit); ``ranges`` bounds ``loss`` and any metric, ``(low, high)`` inclusive,
    so a device's report outside them is refused (a name left out is only required to be finite: a factory task
    declares what it knows)."""

    name: str
    loss: LossFn
    metrics: MetricsFn
    main_metric: str
    higher_is_better: Mapping[str, bool]
    derive: Callable[[dict[str, float]], dict[str, float]] | None = None
    check_targets: Callable[[np.ndarray], str | None] | None = field(default=None, compare=False)
    ranges: Mapping[str, tuple[float, float]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.main_metric != "loss" and self.main_metric not in self.higher_is_better:
            raise ValueError(f"task {self.name!r}: main_metric {self.main_metric!r} is not one of its metrics")
        unknown = sorted(set(self.ranges) - {"loss", *self.higher_is_better})
        if unknown or any(not low <= high for low, high in self.ranges.values()):
            raise ValueError(f"task {self.name!r}: ranges must be (low, high) of loss or its metrics: {self.ranges}")

    def out_of_range(self, name: str, value: float) -> str | None:
        """Why ``value`` cannot be this task's ``name`` (None when it is within its declared range)."""
        low, high = self.ranges.get(name, (-math.inf, math.inf))
        return None if low <= value <= high else f"{self.name} {name} = {value!r} is outside [{low:g}, {high:g}]"

    @property
    def metric_names(self) -> tuple[str, ...]:
        """``loss`` and every metric, the main one first."""
        rest = [m for m in ("loss", *self.higher_is_better) if m != self.main_metric]
        return (self.main_metric, *rest)

    def higher(self, metric: str) -> bool:
        """Whether a larger value of ``metric`` is better (never for the loss)."""
        return False if metric == "loss" else bool(self.higher_is_better[metric])


# ------------------------------------------------------------------------------------------------ built-in tasks
def predicted_labels(outputs: torch.Tensor) -> torch.Tensor:
    """Class ids: argmax, or for a single score column the sign rule (1 where negative), as the SVM predicts."""
    return (outputs.reshape(-1) < 0).to(torch.int64) if outputs.shape[-1] == 1 else outputs.argmax(-1)


def _classification_metrics(outputs: torch.Tensor, targets: torch.Tensor) -> dict[str, float]:
    return {"accuracy": float((predicted_labels(outputs) == targets.long()).double().mean())}


def _class_labels(y: np.ndarray) -> str | None:
    if y.ndim != 1 or not np.issubdtype(y.dtype, np.integer):
        return f"classification needs one integer class id per sample, got {y.dtype} labels of shape {y.shape}"
    return f"classification needs class ids >= 0, got {int(y.min())}" if y.size and y.min() < 0 else None


def _like(targets: torch.Tensor, outputs: torch.Tensor) -> torch.Tensor:
    """Targets as float32 in the outputs' shape ((N,) targets for (N, 1) outputs)."""
    t = targets.to(torch.float32)
    return t.reshape(outputs.shape) if t.numel() == outputs.numel() else t


def _mse(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(outputs, _like(targets, outputs))


def _regression_metrics(outputs: torch.Tensor, targets: torch.Tensor) -> dict[str, float]:
    err = outputs - _like(targets, outputs)
    return {"mae": float(err.abs().mean()), "rmse": math.sqrt(float(err.square().mean()))}


def _rmse_from_loss(means: dict[str, float]) -> dict[str, float]:
    return {**means, "rmse": math.sqrt(means["loss"])} if "loss" in means else means


def _numeric_targets(y: np.ndarray) -> str | None:
    return None if np.issubdtype(y.dtype, np.number) else f"regression needs numeric targets, got {y.dtype}"


def _bce(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.binary_cross_entropy_with_logits(outputs, _like(targets, outputs))


def auc(scores: np.ndarray, labels: np.ndarray) -> float | None:
    """Area under the ROC curve by the rank-sum (Mann-Whitney U), ties averaged; None when one class is absent."""
    pos = labels == 1
    n_pos, n_neg = int(pos.sum()), int((~pos).sum())
    if not n_pos or not n_neg:
        return None
    order = np.argsort(scores, kind="mergesort")
    ranks = np.empty(len(scores), dtype=np.float64)
    sorted_scores = scores[order]
    # average rank of each run of equal scores
    starts = np.flatnonzero(np.r_[True, sorted_scores[1:] != sorted_scores[:-1]])
    ends = np.r_[starts[1:], len(scores)]
    ranks[order] = np.repeat((starts + ends + 1) / 2.0, ends - starts)
    return float((ranks[pos].sum() - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg))


def _binary_metrics(outputs: torch.Tensor, targets: torch.Tensor) -> dict[str, float]:
    scores, labels = outputs.reshape(-1), _like(targets, outputs).reshape(-1)
    out = {"accuracy": float(((scores > 0).to(torch.float32) == labels).double().mean())}
    area = auc(scores.numpy(), labels.numpy())
    return out if area is None else {**out, "auc": area}


def _binary_labels(y: np.ndarray) -> str | None:
    bad = ~np.isin(y, (0, 1))
    return (
        f"binary needs labels 0 or 1, got {y[bad][0]!r} (sample {int(np.flatnonzero(bad)[0])})" if bad.any() else None
    )


def _cross_entropy(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(outputs, targets.long())


FRACTION = (0.0, 1.0)  # a share of samples, or an AUC
NON_NEGATIVE = (0.0, math.inf)  # a loss or an error

TASKS: dict[str, Task] = {
    "classification": Task(
        "classification", _cross_entropy, _classification_metrics, "accuracy", {"accuracy": True},
        check_targets=_class_labels, ranges={"loss": NON_NEGATIVE, "accuracy": FRACTION},
    ),
    "regression": Task(
        "regression", _mse, _regression_metrics, "rmse", {"mae": False, "rmse": False}, _rmse_from_loss,
        check_targets=_numeric_targets, ranges={"loss": NON_NEGATIVE, "mae": NON_NEGATIVE, "rmse": NON_NEGATIVE},
    ),
    "binary": Task(
        "binary", _bce, _binary_metrics, "auc", {"accuracy": True, "auc": True}, check_targets=_binary_labels,
        ranges={"loss": NON_NEGATIVE, "accuracy": FRACTION, "auc": FRACTION},
    ),
}  # fmt: skip


def build_task(spec: Mapping[str, Any], allowed: AllowedCode = SERVER) -> Task:
    """The task of a ``[task]`` spec: ``{}`` (classification), ``{"name": ...}`` or ``{"factory": ..., **kwargs}``."""
    if not isinstance(spec, Mapping):
        raise ValueError(f"task spec must be a mapping, got {type(spec).__name__}")
    kwargs = dict(spec)
    if FACTORY_KEY not in kwargs:
        name = kwargs.pop("name", "classification")
        if kwargs or name not in TASKS:
            raise ValueError(
                f"[task] name = {name!r}{' with keys ' + str(sorted(kwargs)) if kwargs else ''}: expected name = one "
                f'of {", ".join(TASKS)} (no other keys), or factory = "package.module:callable" returning a Task'
            )
        return TASKS[name]
    return build_with_factory("task", kwargs, allowed, Task, "an edge_client.learning.tasks.Task")


def task_loss(model: nn.Module, task: Task) -> LossFn:
    """The model's own ``loss(outputs, targets)`` when it defines one (the SVM's squared hinge), else the task's."""
    return getattr(model, "loss", None) or task.loss


@torch.no_grad()
def evaluate(model: nn.Module, task: Task, data: ArrayDataset, batch_size: int = 1000) -> dict[str, float]:
    """Mean loss and the task's metrics of ``model`` on ``data`` (non-finite metric values are left out)."""
    loss_fn = task_loss(model, task)
    was_training = model.training
    model.eval()
    outputs, total = [], 0.0
    for start in range(0, len(data), batch_size):
        xb = torch.from_numpy(data.x[start : start + batch_size])
        yb = torch.from_numpy(data.y[start : start + batch_size])
        out = model(xb)
        total += float(loss_fn(out, yb)) * len(yb)
        outputs.append(out)
    model.train(was_training)
    result = {"loss": total / max(1, len(data))}
    if outputs:
        result.update(task.metrics(torch.cat(outputs), torch.from_numpy(data.y)))
    return {k: float(v) for k, v in result.items() if math.isfinite(float(v))}


def combine_reports(task: Task, reports: list[tuple[int, Mapping[str, float]]]) -> dict[str, float]:
    """Sample-weighted mean of each metric over the ``(num_samples, metrics)`` reports that carry it, then the task's
    derived metrics."""
    means: dict[str, float] = {}
    for name in ("loss", *task.higher_is_better):
        pairs = [(n, m[name]) for n, m in reports if name in m and n > 0]
        weight = sum(n for n, _ in pairs)
        if weight:
            means[name] = sum(n * v for n, v in pairs) / weight
    return task.derive(means) if task.derive else means
