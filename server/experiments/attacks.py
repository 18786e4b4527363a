"""Dishonest clients for robustness experiments: wrappers around a device's training that simulation and bench put
around a client. The device runtime knows nothing of them; it only lets its training function be replaced.

- ``freeloader``: TACO's lazy client (ALGORITHMS.md 2.7 (f)8): it does no training and uploads the previous global
  update ``w_{t-1} - w_t`` (zeros in its first round), claiming the steps it was told.
- ``scale:SIGMA``: DRAG's scaling attacker (2.8, eq. 5): it trains honestly, then uploads ``p * delta`` with
  ``p ~ N(0, SIGMA^2)`` drawn afresh every round.

Simulated client processes with a behaviour other than ``honest`` run ``python -m server.experiments.attacks
BEHAVIOUR <edge-client run arguments>``: the device's own command line, with its training wrapped.
"""

from __future__ import annotations

import logging
import sys
import zlib

import numpy as np

from edge_client.algorithms.base import ClientAlgorithm
from edge_client.learning.data import ArrayDataset, BatchSampler
from edge_client.learning.flat import FlatModel
from edge_client.loop.runtime import TrainFn
from edge_client.loop.trainer import TrainResult, train_local
from edge_client.wire.messages import RoundFacts
from edge_client.wire.plan import Plan

BEHAVIOURS = "honest, freeloader or scale:SIGMA (e.g. scale:1.7320508 for variance 3)"


def freeloader() -> TrainFn:
    """Uploads the last global update it saw, no computation."""
    previous: list[np.ndarray] = []

    def train(
        flat: FlatModel, weights: np.ndarray, data: ArrayDataset, sampler: BatchSampler, plan: Plan,
        algorithm: ClientAlgorithm, facts: RoundFacts,
    ) -> TrainResult:  # fmt: skip
        current = np.array(weights, dtype=np.float32)
        before = previous[0] if previous and previous[0].size == current.size else current
        previous[:] = [current]
        return TrainResult(before - current, plan.steps, 0.0, 0.0, 0.0)

    return train


def scaler(sigma: float, client_id: str, seed: int = 0) -> TrainFn:
    """Trains honestly, then scales its update by ``p ~ N(0, sigma^2)``, a fresh ``p`` every round."""
    rng = np.random.default_rng([seed, zlib.crc32(client_id.encode())])

    def train(
        flat: FlatModel, weights: np.ndarray, data: ArrayDataset, sampler: BatchSampler, plan: Plan,
        algorithm: ClientAlgorithm, facts: RoundFacts,
    ) -> TrainResult:  # fmt: skip
        result = train_local(flat, weights, data, sampler, plan, algorithm, facts)
        result.delta = (result.delta * np.float32(rng.normal(0.0, sigma))).astype(np.float32)
        return result

    return train


def behaviour(text: str, client_id: str, seed: int = 0) -> TrainFn:
    """The training function of a behaviour named as in ``BEHAVIOURS``."""
    kind, _, arg = text.partition(":")
    if kind == "honest" and not arg:
        return train_local
    if kind == "freeloader" and not arg:
        return freeloader()
    if kind == "scale":
        try:
            sigma = float(arg)
        except ValueError:
            sigma = -1.0
        if sigma > 0:
            return scaler(sigma, client_id, seed)
    raise ValueError(f"unknown client behaviour {text!r}: use {BEHAVIOURS}")


def main(argv: list[str] | None = None) -> int:
    """``BEHAVIOUR run --broker ... --client-id ID ...``: ``edge-client`` with its training wrapped."""
    from edge_client import cli

    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) < 2 or argv[1] != "run":
        print(f"usage: python -m server.experiments.attacks BEHAVIOUR run <edge-client run arguments>; {BEHAVIOURS}")
        return 2
    text, rest = argv[0], argv[1:]
    args = cli.build_parser().parse_args(rest)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return cli.cmd_run(args, train=behaviour(text, args.client_id))


if __name__ == "__main__":
    sys.exit(main())
