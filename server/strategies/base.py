"""The server half of an aggregation algorithm.

The round loop lives once in ``server.orchestrator``; a strategy decides who takes part, the plan each client trains
(``edge_client.wire.plan.Plan``: per-client values such as tau or alpha need no special case), how updates become the
next model, and what else is worth evaluating or recording. Updates reach it only after ``server.admission`` checked
them against the algorithm's contract, so a strategy never sees an undeclared, mis-shaped, non-finite or out-of-bound
field. It works on plain float32 vectors, so every formula can be exercised in-process without a broker. Sign
convention (ALGORITHMS.md C1): ``update.delta = w_sent - w_end``, descent-positive.

Aggregation is folded as updates arrive: ``begin`` opens a round's ``Round`` when its assignments are out, ``fold``
adds each update the moment admission lets it in (into running sums, or into an ``UpdateStore`` for the algorithms
that can weight an update only when all are in), and ``finish`` makes the next model. The server never holds a round's
updates for the streaming algorithms: each is dropped once folded. The strategy's own state changes only in
``finish``, so the orchestrator can restore it when it drops a round, and a round in progress is never checkpointed."""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from edge_client.algorithms.contract import Contract, vector_norm
from edge_client.learning.data import ArrayDataset
from edge_client.learning.tasks import TASKS, Task
from edge_client.wire.messages import RoundFacts, Update
from edge_client.wire.plan import Plan
from server.strategies.running import RunningMean
from server.strategies.store import DEFAULT_RAM_BYTES, UpdateStore

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
    run_dir: Path | None = None  # where an UpdateStore spills rows beyond its RAM bound (None: the temp directory)
    store_ram_bytes: int = DEFAULT_RAM_BYTES  # an UpdateStore's RAM bound


_NO_ARRAY = np.zeros(0, dtype=np.float32)


def without_arrays(update: Update) -> Update:
    """``update`` without its vectors: what is kept of it once folded (ids, counts, timings, scalar values)."""
    return replace(update, delta=_NO_ARRAY, arrays={})


@dataclass(eq=False)
class Round:
    """One round's aggregation in progress, from ``Strategy.begin`` to ``finish``: the model it started from, every
    update folded so far without its vectors, named running sums and, for the algorithms that need it, the store."""

    number: int
    weights: np.ndarray
    reports: list[Update] = field(default_factory=list)
    sums: dict[str, RunningMean] = field(default_factory=dict)
    rows: UpdateStore | None = None
    error: Exception | None = None  # what went wrong while folding: finish() raises it, which drops the round
    norms: dict[str, float] = field(default_factory=dict)  # client -> |delta| as admission measured it
    # client -> the sample count its update weighs as (``server.weight_share``: none above clients.max_weight_share of
    # the round's selected devices); a client not named weighs as it registered
    sample_weights: dict[str, int] = field(default_factory=dict)

    def delta_norm(self, update: Update) -> float:
        """``|update.delta|``: the norm admission measured, or measured now (an update folded without admission)."""
        norm = self.norms.get(update.client_id)
        return vector_norm(update.delta) if norm is None else norm

    def add(self, name: str, vector: np.ndarray, weight: float = 1.0, scale: float = 1.0) -> None:
        """Fold ``vector`` into the running sum ``name`` (see ``RunningMean.add``)."""
        if name not in self.sums:
            self.sums[name] = RunningMean(self.weights.size)
        self.sums[name].add(vector, weight, scale)

    def mean(self, name: str) -> np.ndarray:
        return self.sums[name].mean()

    def store(self) -> UpdateStore:
        assert self.rows is not None, "begin() gives this strategy's rounds a store"
        return self.rows


class Strategy(ABC):
    """One algorithm's server half; its settings, arrays and bounds are the ``contract`` of its client file."""

    contract: ClassVar[Contract]

    def __init__(self, settings: TrainSettings, params: dict[str, Any] | None = None, seed: int = 0) -> None:
        self.settings = settings
        self.params = self.contract.resolve(params)
        self.rng = np.random.default_rng(seed)
        self.ctx = ServerContext(model_spec={}, num_params=0, seed=seed)
        self._store: UpdateStore | None = None

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

    def assign(self, round_: int, client_id: str) -> Plan:
        """The plan ``client_id`` is to train this round: the run's steps and optimiser and the contract's device
        settings.

        Subclasses set per-client steps, per-round values (FedVeca's ``P``, TACO's ``alpha_i``) and arrays, and a
        start model of their own (otherwise the round's global model); the round's facts are the orchestrator's.
        """
        s = self.settings
        return Plan(
            steps=s.local_steps,
            lr=s.lr,
            batch_size=s.batch_size,
            settings=self.contract.device_settings(self.params),
            momentum=s.momentum,
            weight_decay=s.weight_decay,
        )

    # -- aggregation, folded as updates arrive ----------------------------------------------------------------------
    def begin(self, round_: int, weights: np.ndarray) -> Round:
        """Open ``round_``'s aggregation from the global model ``weights`` (called once its assignments are out)."""
        return Round(round_, weights)

    def fold(self, rnd: Round, update: Update, norm: float | None = None) -> Update:
        """Fold one admitted update into ``rnd`` now; returns it without its vectors, all that needs keeping of it.
        ``norm`` is the norm of its delta that admission measured (``Round.delta_norm``). Its sample count is the
        capped one of ``rnd.sample_weights``, here, once, for every algorithm that weights by samples.

        An error is logged and kept for ``finish`` to raise: it drops the round, never the run.
        """
        if norm is not None:
            rnd.norms[update.client_id] = norm
        weight = rnd.sample_weights.get(update.client_id, update.num_samples)
        if weight != update.num_samples:
            update = replace(update, num_samples=weight)
        if rnd.error is None:
            try:
                self.add(rnd, update)
            except Exception as exc:
                log.exception("round %d: folding the update of %s failed", rnd.number, update.client_id)
                rnd.error = exc
        report = without_arrays(update)
        rnd.reports.append(report)
        return report

    @abstractmethod
    def add(self, rnd: Round, update: Update) -> None:
        """Fold ``update`` into ``rnd``'s running sums or store; nothing but ``rnd`` changes."""

    def finish(self, rnd: Round) -> np.ndarray:
        """The next global model from what was folded into ``rnd`` (at least one update); the strategy's own state
        changes only here, and the round's store lets go of its rows."""
        try:
            if rnd.error is not None:
                raise rnd.error
            if not rnd.reports:
                raise ValueError(f"round {rnd.number}: finish() without a folded update")
            return self.close(rnd)
        finally:
            if rnd.rows is not None:
                rnd.rows.clear()

    @abstractmethod
    def close(self, rnd: Round) -> np.ndarray:
        """The next global model from ``rnd``'s sums, and this strategy's state for the next round."""

    def aggregate(self, round_: int, weights: np.ndarray, updates: list[Update]) -> np.ndarray:
        """A whole round at once: ``begin``, ``fold`` each of ``updates`` in order, ``finish``."""
        rnd = self.begin(round_, weights)
        for update in updates:
            self.fold(rnd, update)
        return self.finish(rnd)

    def update_store(self, size: int, reference: np.ndarray | None = None) -> UpdateStore:
        """This strategy's store, emptied for a new round (one store, reused: its spill file's pages stay mapped),
        dotting each row with ``reference`` on arrival when one is given (``UpdateStore.scores``)."""
        if self._store is None or self._store.size != size:
            self._store = UpdateStore(size, self.ctx.run_dir, self.ctx.store_ram_bytes)
        self._store.clear(reference)
        return self._store

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


def assignment_summary(plan: Plan, facts: RoundFacts) -> dict[str, Any]:
    """The scalar part of what a client was told, for metrics.jsonl."""
    out: dict[str, Any] = {"local_steps": plan.steps, "lr": plan.lr, "batch_size": plan.batch_size}
    if plan.settings:
        out["settings"] = plan.settings
    if plan.arrays:
        out["arrays"] = sorted(plan.arrays)
    if not facts.upload:
        out["upload"] = False
    return out
