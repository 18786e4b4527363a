"""Differential privacy around a strategy's aggregation (docs/privacy.md), so no strategy changes for it.

Central mode (DP-FedAvg, McMahan et al. 2018): each available device is selected independently with probability
``clients.fraction`` (Poisson sampling, what the accountant counts), from a generator seeded by ``secrets``; every
update weighs the same; the server clips what it received once more (a codec's error or a device that did not clip
cannot raise the sensitivity above ``clip_norm``), adds ``N(0, (z C)^2)`` to each running sum the strategy folded
(SCAFFOLD's ``delta_c`` and STEM's ``v`` too: they were clipped jointly with ``delta``), and divides by the expected
number of devices ``clients.fraction x clients.count`` instead of the number that reported. With
``secure_aggregation`` the server adds nothing: each of the n selected devices adds a share of std ``z C / sqrt(n)``.
Local mode: each device adds ``N(0, (z C)^2)`` to its own clipped update; the server aggregates as the strategy does.
Adaptive clipping (Andrew et al. 2021): the clip norm follows the ``target_quantile`` of the update norms, from the
noised count of devices that were within it: ``C <- C exp(-eta (b - target_quantile))``.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import numpy as np

from edge_client.algorithms.contract import vector_norm
from edge_client.loop.dp import CLIP_MARGIN, noise_rng
from edge_client.wire.messages import Update
from edge_client.wire.plan import Plan
from server.config import RunConfig
from server.dp.budget import Budget, budget_of
from server.strategies import Strategy
from server.strategies.base import Round


def clip_update(update: Update, clip_norm: float, norm: float | None = None) -> tuple[Update, float]:
    """``update`` with its delta and arrays scaled jointly to an L2 norm of at most ``clip_norm``, and that norm."""
    vectors = [update.delta, *update.arrays.values()]
    delta_norm = vector_norm(update.delta) if norm is None else norm
    total = math.sqrt(delta_norm**2 + sum(vector_norm(v) ** 2 for v in vectors[1:]))
    if total <= clip_norm:
        return update, delta_norm
    scale = np.float32(clip_norm / total * CLIP_MARGIN)
    arrays = {k: v * scale for k, v in update.arrays.items()}
    return replace(update, delta=update.delta * scale, arrays=arrays), delta_norm * float(scale)


class PrivateStrategy:
    """``inner`` with the mechanism around its selection, assignments and aggregation; the rest is ``inner``'s."""

    def __init__(self, inner: Strategy, budget: Budget) -> None:
        self.inner = inner
        self.budget = budget
        self.clip_norm = budget.clip_norm  # C of the round being assigned (it moves with adaptive clipping)
        self.used_clip_norm = budget.clip_norm  # C of the last round aggregated (its metrics row)
        self._sampler = noise_rng()
        self._selected = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    @property
    def central(self) -> bool:
        return self.budget.mode == "central"

    def select(self, round_: int, available: list[str]) -> list[str]:
        """Central: each available device independently with probability ``clients.fraction`` (may be none)."""
        if not self.central:
            chosen = self.inner.select(round_, available)
        else:
            q = self.budget.sampling_rate
            chosen = sorted(c for c in available if q >= 1 or self._sampler.random() < q)
        self._selected = len(chosen)
        return chosen

    def device_noise_std(self) -> float:
        """What each device adds: all of it in local mode, its share with secure aggregation, else nothing."""
        b = self.budget
        if b.local:
            return b.noise_multiplier * self.clip_norm
        if b.secure_aggregation:
            return noise_share_std(b.update_multiplier * self.clip_norm, self._selected)
        return 0.0

    def assign(self, round_: int, client_id: str) -> Plan:
        a = self.inner.assign(round_, client_id)
        std = self.device_noise_std()
        a.settings = {**a.settings, "dp_clip_norm": self.clip_norm, **({"dp_noise_std": std} if std else {})}
        return a

    def fold(self, rnd: Round, update: Update, norm: float | None = None) -> Update:
        if self.central:
            rnd.sample_weights[update.client_id] = 1  # every update weighs the same: a weight is a per-device release
            if not self.budget.secure_aggregation:  # a masked update cannot be clipped again
                update, norm = clip_update(update, self.clip_norm, norm)
        return self.inner.fold(rnd, update, norm)

    def finish(self, rnd: Round) -> np.ndarray:
        if self.central:
            noise_sums(rnd, 0.0 if self.budget.secure_aggregation else self.budget.update_multiplier * self.clip_norm)
            for acc in rnd.sums.values():
                acc.weight = self.budget.expected_devices
        new = self.inner.finish(rnd)
        self.used_clip_norm = self.clip_norm
        if self.budget.adaptive:
            within = sum(int(u.extras.get("dp_within", 0)) for u in rnd.reports)
            self.clip_norm = adapted_clip_norm(self.clip_norm, within, self.budget, noise_rng())
        return new

    def state_dict(self) -> dict[str, Any]:
        return {**self.inner.state_dict(), "dp_clip_norm": self.clip_norm}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        state = dict(state)
        self.clip_norm = float(state.pop("dp_clip_norm", self.clip_norm))
        self.inner.load_state_dict(state)


def noise_share_std(total_std: float, devices: int) -> float:
    """Each of ``devices`` devices' share of the noise: their independent shares sum to std ``total_std``."""
    return total_std / math.sqrt(max(1, devices))


def noise_sums(rnd: Round, std: float) -> None:
    """``N(0, std^2)`` per coordinate added to each running sum of ``rnd``, from a CSPRNG-seeded generator."""
    if std <= 0:
        return
    rng = noise_rng()
    for acc in rnd.sums.values():
        acc.total += rng.normal(0.0, std, acc.total.shape).astype(np.float32)


def adapted_clip_norm(clip_norm: float, within: int, budget: Budget, rng: np.random.Generator) -> float:
    """Andrew et al.'s geometric update from the noised fraction of devices within the clip norm."""
    noised = (within + rng.normal(0.0, budget.count_multiplier / 2)) / max(budget.expected_devices, 1e-12)
    return float(clip_norm * math.exp(-budget.clip_learning_rate * (noised - budget.target_quantile)))


class Privacy:
    """The orchestrator's one handle: wraps the strategy, says when the budget is spent, puts epsilon in the outputs.
    With ``[privacy] mode = "off"`` every method is a no-op."""

    def __init__(self, config: RunConfig) -> None:
        self.budget = None if config.privacy.mode == "off" else budget_of(config)
        self.stopped_before = 0  # the round the budget stopped the run before (0: it did not)

    def wrap(self, strategy: Strategy) -> Strategy:
        return strategy if self.budget is None else PrivateStrategy(strategy, self.budget)  # type: ignore[return-value]

    def exhausted(self, round_: int) -> bool:
        """Round ``round_`` would spend more than ``[privacy] target_epsilon``: the run stops before it."""
        if self.budget is not None and self.budget.exhausted(round_):
            self.stopped_before = round_
            return True
        return False

    def row(self, round_: int, strategy: Strategy) -> dict[str, Any]:
        """Epsilon spent after ``round_`` rounds (and the clip norm the round used) for its metrics row."""
        if self.budget is None:
            return {}
        return {
            "epsilon": self.budget.epsilon(round_),
            "delta": self.budget.delta,
            "clip_norm": strategy.used_clip_norm,
        }

    def summary(self, rows: list[dict[str, Any]]) -> dict[str, Any]:
        if self.budget is None:
            return {}
        b = self.budget
        rounds = rows[-1]["round"] if rows else 0
        stopped = (
            f"stopped before round {self.stopped_before}: it would have spent more than target_epsilon "
            f"{b.target_epsilon:g}"
            if self.stopped_before
            else ""
        )
        return {
            "privacy": {
                "mode": b.mode, "epsilon": b.epsilon(rounds), "delta": b.delta, "rounds": rounds,
                "noise_multiplier": b.noise_multiplier, "noise_multiplier_derived": b.derived,
                "clip_norm": b.clip_norm, "adaptive_clipping": b.adaptive,
                "final_clip_norm": rows[-1]["clip_norm"] if rows else b.clip_norm, "sampling_rate": b.sampling_rate,
                "target_epsilon": b.target_epsilon or None, "stopped_by_budget": stopped,
                "accountant": "dp-accounting RDP",
            }
        }  # fmt: skip
