"""Dishonest clients for robustness experiments; an honest device never uses this module.

- ``freeloader``: TACO's lazy client (ALGORITHMS.md 2.7 (f)8): it does no training and uploads the previous global
  update ``w_{t-1} - w_t`` (zeros in its first round), claiming the steps it was told.
- ``scale:SIGMA``: DRAG's scaling attacker (2.8, eq. 5): it trains honestly, then uploads ``p * delta`` with
  ``p ~ N(0, SIGMA^2)`` drawn afresh every round.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import numpy as np

from edge_client.protocol import Assignment
from edge_client.trainer import TrainResult

BEHAVIOURS = "honest, freeloader or scale:SIGMA (e.g. scale:1.7320508 for variance 3)"


@dataclass
class Behaviour:
    kind: str = "honest"
    sigma: float = 0.0
    _previous: np.ndarray | None = None
    _rng: np.random.Generator | None = None

    @classmethod
    def parse(cls, text: str, client_id: str = "", seed: int = 0) -> Behaviour:
        kind, _, arg = text.partition(":")
        if kind in ("honest", "freeloader") and not arg:
            return cls(kind)
        if kind == "scale":
            try:
                sigma = float(arg)
            except ValueError:
                sigma = -1.0
            if sigma > 0:
                return cls("scale", sigma, _rng=np.random.default_rng([seed, zlib.crc32(client_id.encode())]))
        raise ValueError(f"unknown client behaviour {text!r}: use {BEHAVIOURS}")

    @property
    def trains(self) -> bool:
        return self.kind != "freeloader"

    def freeload(self, assignment: Assignment) -> TrainResult:
        """The freeloader's upload: the last global update it saw, no computation."""
        current = np.array(assignment.weights, dtype=np.float32)
        previous = self._previous if self._previous is not None and self._previous.size == current.size else current
        self._previous = current
        return TrainResult(previous - current, assignment.local_steps, 0.0, 0.0, 0.0)

    def tamper(self, result: TrainResult) -> TrainResult:
        """What an attacker uploads instead of its honest result."""
        if self.kind == "scale":
            assert self._rng is not None
            result.delta = (result.delta * np.float32(self._rng.normal(0.0, self.sigma))).astype(np.float32)
        return result
