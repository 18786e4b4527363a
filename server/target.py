"""The run's target: which metric, from which evaluation, reaching which value counts as done (time-to-target).

``run.target_metric`` (default: the task's main metric) and ``run.target`` set it, ``run.higher_is_better`` overrides
the metric's own direction; for classification's accuracy ``run.target_accuracy`` is the shorthand. The metric is read
from the server's test set when the server evaluates (``[eval] mode`` server or both), else from the devices'
sample-weighted reports (``row["client_eval"]``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from edge_client.learning.tasks import Task
from server.config import ConfigError, RunConfig

log = logging.getLogger("edgefl.target")

#: [eval] mode values; "" means: server when the server holds a test set, else clients
EVAL_MODES = ("server", "clients", "both")


@dataclass(frozen=True)
class Target:
    metric: str
    value: float | None  # None: no target set; time-to-target is then not measured
    higher_is_better: bool
    source: str  # "server" or "clients": whose evaluation the metric is read from

    @classmethod
    def accuracy(cls, value: float) -> Target:
        """Test-set accuracy reaching ``value``: the classification default."""
        return cls("accuracy", value, True, "server")

    def of(self, row: dict[str, Any], metric: str | None = None) -> float | None:
        """``metric`` (default: the target's) of one metrics row, from the target's source; None if not evaluated."""
        values = row if self.source == "server" else row.get("client_eval") or {}
        value = values.get(metric or self.metric)
        return float(value) if isinstance(value, (int, float)) else None

    def reached(self, value: float | None) -> bool:
        if value is None or self.value is None:
            return False
        return value >= self.value if self.higher_is_better else value <= self.value

    def better(self, value: float | None, than: float | None) -> bool:
        if value is None:
            return False
        return than is None or (value > than if self.higher_is_better else value < than)

    def describe(self) -> dict[str, Any]:
        """For summary.json: what the target was and whose evaluation measured it."""
        return {
            "target_metric": self.metric,
            "target": self.value,
            "higher_is_better": self.higher_is_better,
            "evaluated_by": "server test set" if self.source == "server" else "devices' held-out splits",
        }


def eval_mode(config: RunConfig, server_has_test_set: bool) -> str:
    """The configured ``[eval] mode``, or its default; a mode the server cannot serve is a configuration error."""
    mode = config.eval.mode or ("server" if server_has_test_set else "clients")
    if mode in ("server", "both") and not server_has_test_set:
        raise ConfigError(
            f'eval.mode = "{mode}" needs a test set on the server, and data.dataset = "none"; use mode = "clients" '
            "(the devices evaluate on their --holdout split) or name a data set"
        )
    return mode


#: The share of its shard a simulated device holds out when the devices evaluate and ``[eval] holdout`` is 0: a run
#: told to evaluate on the devices must not go through every round with nothing to evaluate on.
DEFAULT_DEVICE_HOLDOUT = 0.1


def simulated_holdout(config: RunConfig) -> float:
    """The share of its shard each simulated device (simulate, bench) holds out: ``[eval] holdout``, else
    DEFAULT_DEVICE_HOLDOUT when the devices evaluate (mode clients or both), else none. A simulation's server always
    holds the data set's test split."""
    mode = eval_mode(config, server_has_test_set=True)
    if config.eval.holdout or mode == "server":
        return config.eval.holdout
    log.info("[eval] mode = %r and holdout = 0: each simulated device holds out %.0f%% of its shard to evaluate on "
             "(set [eval] holdout to choose the share)", mode, 100 * DEFAULT_DEVICE_HOLDOUT)  # fmt: skip
    return DEFAULT_DEVICE_HOLDOUT


def run_target(config: RunConfig, task: Task, mode: str) -> Target:
    """The target of ``config`` for ``task``, checked against the task's metrics."""
    run = config.run
    metric = run.target_metric or task.main_metric
    if metric not in task.metric_names:
        raise ConfigError(
            f"run.target_metric = {metric!r} is not a metric of the {task.name} task; choose one of "
            f"{', '.join(task.metric_names)}"
        )
    value = run.target
    if value is None and task.name == "classification" and metric == "accuracy":
        value = run.target_accuracy
    higher = task.higher(metric) if run.higher_is_better is None else run.higher_is_better
    return Target(metric, value, higher, "clients" if mode == "clients" else "server")
