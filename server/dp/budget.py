"""The run's privacy parameters, fixed before round 1, and the epsilon spent after each round (``accountant``)."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

from server.config import RunConfig
from server.dp import accountant
from server.dp.settings import default_delta

log = logging.getLogger("edgefl.server")


@dataclass(frozen=True)
class Budget:
    """``noise_multiplier`` z is the whole mechanism's, the one the accountant counts. With adaptive clipping part of
    it pays for the noised count of unclipped updates (Andrew et al. 2021, eq. 3): the count's multiplier is
    ``count_multiplier`` = max(expected devices / 10, 3 z) (the paper's std of m/20 on a sum of sensitivity 1/2, but
    never more than a ninth of the budget), and the update's is ``(z^-2 - count_multiplier^-2)^-1/2``."""

    mode: str
    clip_norm: float
    noise_multiplier: float
    delta: float
    sampling_rate: float
    rounds: int
    target_epsilon: float
    derived: bool  # the multiplier was derived from target_epsilon
    expected_devices: float
    adaptive: bool
    secure_aggregation: bool
    target_quantile: float = 0.5
    clip_learning_rate: float = 0.2

    @property
    def local(self) -> bool:
        return self.mode == "local"

    @property
    def count_multiplier(self) -> float:
        return max(self.expected_devices / 10, 3 * self.noise_multiplier) if self.adaptive else math.inf

    @property
    def update_multiplier(self) -> float:
        """The multiplier of the noise on the update's sum (z itself without adaptive clipping)."""
        z = self.noise_multiplier
        return (z**-2 - self.count_multiplier**-2) ** -0.5 if self.adaptive else z

    def epsilon(self, rounds: int) -> float:
        """Epsilon spent by ``rounds`` rounds at ``delta``."""
        return accountant.epsilon(self.noise_multiplier, self.sampling_rate, rounds, self.delta, self.local)

    def exhausted(self, round_: int) -> bool:
        """Round ``round_`` would spend more than ``target_epsilon``."""
        return self.target_epsilon > 0 and self.epsilon(round_) > self.target_epsilon

    def describe(self) -> str:
        how = f"derived from target_epsilon {self.target_epsilon:g}" if self.derived else "as configured"
        return (
            f"{self.mode} differential privacy: clip_norm {self.clip_norm:g}{' (adaptive)' if self.adaptive else ''}, "
            f"noise_multiplier {self.noise_multiplier:.4f} ({how}), sampling rate {self.sampling_rate:g}, "
            f"delta {self.delta:.3g}: epsilon {self.epsilon(self.rounds):.3f} after {self.rounds} rounds"
        )


def budget_of(config: RunConfig) -> Budget:
    """The run's budget; the multiplier derived from ``target_epsilon`` over ``run.rounds`` when not configured."""
    p, q = config.privacy, config.clients.fraction
    local = p.mode == "local"
    delta = p.delta or default_delta(config.clients.count)
    z = p.noise_multiplier
    if not z:
        z = accountant.calibrate(p.target_epsilon, q, config.run.rounds, delta, local)
        while accountant.epsilon(z, q, config.run.rounds, delta, local) > p.target_epsilon:
            z *= 1.0001  # Brent's tolerance may land a hair above the budget
    budget = Budget(
        p.mode, p.clip_norm, z, delta, q, config.run.rounds, p.target_epsilon, not p.noise_multiplier,
        q * config.clients.count, p.adaptive_clipping, p.secure_aggregation, p.target_quantile, p.clip_learning_rate,
    )  # fmt: skip
    log.warning("%s", budget.describe())
    return budget
