"""The server half of an aggregation algorithm.

The round loop lives once in ``server.orchestrator``; a strategy decides who takes part, what each client is told
(so per-client values such as tau or alpha need no special case), how updates become the next model, and what else
is worth evaluating or recording. It works on plain float32 vectors, so every formula can be exercised in-process
without a broker. Sign convention (ALGORITHMS.md C1): ``update.delta = w_sent - w_end``, descent-positive.
"""

from __future__ import annotations

import json
import logging
import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from edge_client.data import ArrayDataset
from edge_client.protocol import InvalidField, MissingField, ShapeMismatch, Update

log = logging.getLogger("edgefl.server")


@dataclass
class TrainSettings:
    """The run-wide defaults a strategy starts from when it instructs a client."""

    local_steps: int
    lr: float
    batch_size: int
    fraction: float = 1.0


@dataclass
class ServerContext:
    """What the server knows beyond the weights; ``clients`` is kept up to date as clients register."""

    model_spec: dict[str, Any]
    num_params: int
    clients: dict[str, int] = field(default_factory=dict)  # client id -> number of local samples
    root: ArrayDataset | None = None  # server-side data (DRAG-BR's root data set)
    seed: int = 0


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
    weights: np.ndarray | None = None  # a model to send instead of the global one (FedACG's look-ahead)

    def summary(self) -> dict[str, Any]:
        """The scalar part, for metrics.jsonl."""
        out: dict[str, Any] = {"local_steps": self.local_steps, "lr": self.lr, "batch_size": self.batch_size}
        if self.alpha is not None:
            out["alpha"] = self.alpha
        if self.params:
            out["params"] = self.params
        if self.arrays:
            out["arrays"] = sorted(self.arrays)
        if not self.upload:
            out["upload"] = False
        return out


class Strategy(ABC):
    name: ClassVar[str]
    description: ClassVar[str] = ""
    #: Hyper-parameters with their defaults (namespaced in config files as ``[algorithm.<name>]``).
    defaults: ClassVar[dict[str, Any]] = {}
    #: Scalars / vectors an update must carry; an update without them is rejected before aggregation.
    required_extras: ClassVar[tuple[str, ...]] = ()
    required_arrays: ClassVar[tuple[str, ...]] = ()
    #: Parameters restricted to a set of values, checked when the strategy is made (a config error, not a crash).
    choices: ClassVar[dict[str, tuple[Any, ...]]] = {}

    def __init__(self, settings: TrainSettings, params: dict[str, Any] | None = None, seed: int = 0) -> None:
        unknown = set(params or {}) - set(self.defaults)
        if unknown:
            raise ValueError(
                f"unknown parameter(s) {sorted(unknown)} for algorithm {self.name!r}; "
                f"valid: {sorted(self.defaults) or 'none'}"
            )
        self.settings = settings
        self.params = {**self.defaults, **(params or {})}
        for key, allowed in self.choices.items():
            if self.params[key] not in allowed:
                raise ValueError(f"{self.name}.{key} must be one of {list(allowed)}; got {self.params[key]!r}")
        for key, default in self.defaults.items():
            value = self.params[key]
            if isinstance(default, float) and isinstance(value, int) and not isinstance(value, bool):
                self.params[key] = value = float(value)
            if default is not None and type(value) is not type(default):
                kind = type(default).__name__
                raise ValueError(f"{self.name}.{key} must be of type {kind}; got {value!r} ({type(value).__name__})")
        self.rng = np.random.default_rng(seed)
        self.ctx = ServerContext(model_spec={}, num_params=0, seed=seed)

    def setup(self, ctx: ServerContext) -> None:
        """Called once before round 1."""
        self.ctx = ctx

    def root_size(self) -> int:
        """Samples of server-side data this strategy needs (taken from data no client holds)."""
        return 0

    def check_update(self, update: Update) -> None:
        """Reject (with a specific ProtocolError) an update that lacks what this strategy's aggregation needs."""
        who = f"{update.client_id}: {self.name} updates"
        missing = [k for k in self.required_extras if k not in update.extras]
        missing += [k for k in self.required_arrays if k not in update.arrays]
        if missing:
            raise MissingField(f"{who} must carry {missing}")
        for key in self.required_extras:
            value = update.extras[key]
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
                raise InvalidField(f"{who} need a finite number as {key!r}; got {value!r}")
        for key in self.required_arrays:
            if update.arrays[key].shape != (self.ctx.num_params,):
                raise ShapeMismatch(
                    f"{who} need {key!r} of shape ({self.ctx.num_params},); got {update.arrays[key].shape}"
                )

    def select(self, round_: int, available: list[str]) -> list[str]:
        """Clients that train and upload this round: a uniform sample of ``fraction`` of them (at least one)."""
        if self.settings.fraction >= 1.0:
            return list(available)
        count = max(1, round(self.settings.fraction * len(available)))
        return sorted(self.rng.choice(available, size=count, replace=False).tolist())

    def train_only(self, round_: int, available: list[str], selected: list[str]) -> list[str]:
        """Clients told to train without uploading (FedUmf's unselected clients)."""
        return []

    def instructions(self, round_: int, client_id: str) -> Instructions:
        s = self.settings
        return Instructions(local_steps=s.local_steps, lr=s.lr, batch_size=s.batch_size)

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


STATE_PREFIX = "strategy."


def pack_state(strategy: Strategy) -> dict[str, np.ndarray]:
    """``strategy``'s state as npz entries: each array as itself, the rest (and the selection RNG) as one JSON string.

    Vectors stay binary (a d-float list in JSON is ~20 bytes a value and slow to parse); small per-client dicts are
    JSON, which round-trips Python floats exactly.
    """
    state = strategy.state_dict()
    arrays = {STATE_PREFIX + k: v for k, v in state.items() if isinstance(v, np.ndarray)}
    rest = {k: v for k, v in state.items() if not isinstance(v, np.ndarray)}
    meta = {"state": rest, "arrays": sorted(k for k, v in state.items() if isinstance(v, np.ndarray)),
            "rng": strategy.rng.bit_generator.state}  # fmt: skip
    return {**arrays, "strategy": np.array(json.dumps(meta))}


def unpack_state(strategy: Strategy, saved: Any) -> None:
    """Restore what ``pack_state`` wrote into ``saved`` (an open npz file or a dict of arrays) after ``setup``."""
    meta = json.loads(str(saved["strategy"]))
    state = {**meta["state"], **{k: np.array(saved[STATE_PREFIX + k]) for k in meta["arrays"]}}
    strategy.load_state_dict(state)
    strategy.rng.bit_generator.state = meta["rng"]
