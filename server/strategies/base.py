"""The server half of an aggregation algorithm.

The round loop lives once in ``server.orchestrator``; a strategy decides who takes part, what each client is told (so
per-client values such as tau or alpha need no special case), how updates become the next model, and what else is worth
evaluating or recording. Updates reach it only after ``server.admission`` checked them against the algorithm's contract,
so a strategy never sees an undeclared, mis-shaped, non-finite or out-of-bound field. It works on plain float32 vectors,
so every formula can be exercised in-process without a broker. Sign convention (ALGORITHMS.md C1): ``update.delta =
w_sent - w_end``, descent-positive."""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from edge_client.contract import Contract
from edge_client.data import ArrayDataset
from edge_client.protocol import Assignment, Update
from edge_client.tasks import TASKS, Task

log = logging.getLogger("edgefl.server")


@dataclass
class TrainSettings:
    """The run-wide defaults a strategy starts from when it instructs a client (``[train]`` and the fraction C)."""

    local_steps: int
    lr: float
    batch_size: int
    fraction: float = 1.0
    momentum: float = 0.0
    weight_decay: float = 0.0


@dataclass
class ServerContext:
    """What the server knows beyond the weights; ``clients`` is kept up to date as clients register."""

    model_spec: dict[str, Any]
    num_params: int
    clients: dict[str, int] = field(default_factory=dict)  # client id -> number of local samples (as registered)
    root: ArrayDataset | None = None  # server-side data (DRAG-BR's root data set)
    seed: int = 0
    task: Task = TASKS["classification"]  # the run's task: the loss of training on the server (DRAG-BR's root)


class Strategy(ABC):
    """One algorithm's server half; its settings, arrays and bounds are the ``contract`` of its client file."""

    contract: ClassVar[Contract]

    def __init__(self, settings: TrainSettings, params: dict[str, Any] | None = None, seed: int = 0) -> None:
        self.settings = settings
        self.params = self.contract.resolve(params)
        self.rng = np.random.default_rng(seed)
        self.ctx = ServerContext(model_spec={}, num_params=0, seed=seed)

    @property
    def name(self) -> str:
        return self.contract.name

    def setup(self, ctx: ServerContext) -> None:
        """Called once before round 1."""
        self.ctx = ctx

    def root_size(self, train_size: int) -> int:
        """Samples of server-side data this strategy needs (taken from the ``train_size`` samples no client holds)."""
        return 0

    def select(self, round_: int, available: list[str]) -> list[str]:
        """Clients that train and upload this round: a uniform sample of ``fraction`` of them (at least one)."""
        if self.settings.fraction >= 1.0:
            return list(available)
        count = max(1, round(self.settings.fraction * len(available)))
        return sorted(self.rng.choice(available, size=count, replace=False).tolist())

    def train_only(self, round_: int, available: list[str], selected: list[str]) -> list[str]:
        """Clients told to train without uploading (FedUmf's unselected clients)."""
        return []

    def assign(self, round_: int, client_id: str) -> Assignment:
        """What ``client_id`` is told this round: the run's steps and optimiser and the contract's device settings.

        Subclasses add per-client steps, TACO's alpha_i, per-round values and arrays; the orchestrator fills the
        round's facts (round, model version, deadline, global weights unless a strategy set its own).
        """
        s = self.settings
        return Assignment(
            local_steps=s.local_steps,
            lr=s.lr,
            batch_size=s.batch_size,
            settings=self.contract.device_settings(self.params),
            momentum=s.momentum,
            weight_decay=s.weight_decay,
        )

    @abstractmethod
    def aggregate(self, round_: int, weights: np.ndarray, updates: list[Update]) -> np.ndarray:
        """The next global model from the current one and this round's accepted updates (at least one)."""

    def excluded(self) -> set[str]:
        """Clients never to be selected again (TACO's expelled freeloaders)."""
        return set()

    def outputs(self, weights: np.ndarray) -> dict[str, np.ndarray]:
        """Other models to evaluate beside ``weights`` each round, by name (TACO's z)."""
        return {}

    def round_metrics(self) -> dict[str, Any]:
        """Algorithm state worth a line in metrics.jsonl after the last aggregation."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        """Algorithm state to checkpoint beside the model: numpy arrays (stored as npz arrays) and JSON values."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:  # noqa: B027 (stateless strategies keep nothing)
        """Restore what ``state_dict`` returned."""


def assignment_summary(a: Assignment) -> dict[str, Any]:
    """The scalar part of what a client was told, for metrics.jsonl."""
    out: dict[str, Any] = {"local_steps": a.local_steps, "lr": a.lr, "batch_size": a.batch_size}
    if a.alpha is not None:
        out["alpha"] = a.alpha
    if a.settings:
        out["settings"] = a.settings
    if a.arrays:
        out["arrays"] = sorted(a.arrays)
    if not a.upload:
        out["upload"] = False
    if a.model_sha256:  # the downlink codec is on: the full model, or the difference from the last one
        out["downlink"] = "difference" if a.diff_base else "full"
    return out
