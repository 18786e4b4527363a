"""The server half of an aggregation algorithm.

The round loop lives once in ``server.orchestrator``; a strategy only decides who takes part, what each client is
told (so per-client values such as tau or alpha need no special case), and how updates become the next model. It
works on plain float32 vectors, so every formula can be exercised in-process without a broker.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from edge_client.protocol import Update


@dataclass
class TrainSettings:
    """The run-wide defaults a strategy starts from when it instructs a client."""

    local_steps: int
    lr: float
    batch_size: int
    fraction: float = 1.0


@dataclass
class Instructions:
    """What one client is told for one round (beside the global weights)."""

    local_steps: int
    lr: float
    batch_size: int
    alpha: float | None = None
    params: dict[str, Any] = field(default_factory=dict)
    arrays: dict[str, np.ndarray] = field(default_factory=dict)
    upload: bool = True

    def summary(self) -> dict[str, Any]:
        """The scalar part, for metrics.jsonl."""
        out: dict[str, Any] = {"local_steps": self.local_steps, "lr": self.lr, "batch_size": self.batch_size}
        if self.alpha is not None:
            out["alpha"] = self.alpha
        if self.params:
            out["params"] = self.params
        if not self.upload:
            out["upload"] = False
        return out


class Strategy(ABC):
    name: ClassVar[str]
    #: Hyper-parameters with their defaults (namespaced in config files as ``[algorithm.<name>]``).
    defaults: ClassVar[dict[str, Any]] = {}
    #: Scalars / vectors an update must carry; an update without them is rejected before aggregation.
    required_extras: ClassVar[tuple[str, ...]] = ()
    required_arrays: ClassVar[tuple[str, ...]] = ()

    def __init__(self, settings: TrainSettings, params: dict[str, Any] | None = None, seed: int = 0) -> None:
        unknown = set(params or {}) - set(self.defaults)
        if unknown:
            raise ValueError(
                f"unknown parameter(s) {sorted(unknown)} for algorithm {self.name!r}; "
                f"valid: {sorted(self.defaults) or 'none'}"
            )
        self.settings = settings
        self.params = {**self.defaults, **(params or {})}
        self.rng = np.random.default_rng(seed)

    def select(self, round_: int, available: list[str]) -> list[str]:
        """Clients that train and upload this round: a uniform sample of ``fraction`` of them (at least one)."""
        if self.settings.fraction >= 1.0:
            return list(available)
        count = max(1, round(self.settings.fraction * len(available)))
        return sorted(self.rng.choice(available, size=count, replace=False).tolist())

    def instructions(self, round_: int, client_id: str) -> Instructions:
        s = self.settings
        return Instructions(local_steps=s.local_steps, lr=s.lr, batch_size=s.batch_size)

    @abstractmethod
    def aggregate(self, round_: int, weights: np.ndarray, updates: list[Update]) -> np.ndarray:
        """The next global model from the current one and this round's accepted updates (at least one)."""

    def state_dict(self) -> dict[str, Any]:
        """Algorithm state to checkpoint beside the model."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:  # noqa: B027 (stateless strategies keep nothing)
        """Restore what ``state_dict`` returned."""
