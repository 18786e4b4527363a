"""Staleness: how much an update trained on an older model version counts, and when it is refused.

FedBuff (Nguyen et al., AISTATS 2022) aggregates as soon as ``train.buffer_size`` (K) updates are in. An update trained
on version ``v`` while the server is at version ``V`` has staleness ``s = V - v``; it is weighted by ``w(s)``:

    "sqrt"        w(s) = 1 / sqrt(1 + s)          (the paper's choice; the default)
    "polynomial"  w(s) = (1 + s) ** -a            (a = ``train.staleness_exponent``; a = 0.5 is "sqrt")
    "constant"    w(s) = 1

and refused (reason ``staleness``) when ``s > train.max_staleness``. The step is ``w <- w - eta_g * sum_i p_i w(s_i)
delta_i`` with ``p_i`` the algorithm's own weights over the buffer (FedAvg: 1/K or D_i/D; FedNova: normalised by each
update's steps) and ``eta_g = train.server_lr``: the strategy folds each delta scaled by its ``w(s)``
(``weighted``), and ``server_step`` takes ``eta_g`` of the strategy's step. No strategy is changed, so the contract's
``buffered`` flag says which of them this is correct for.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from edge_client.wire.messages import Update
from edge_client.wire.protocol import OutOfRound

MODES = ("synchronous", "buffered")
STALENESS_WEIGHTS = ("sqrt", "polynomial", "constant")


class Stale(OutOfRound):
    """An update trained on a model version more than ``train.max_staleness`` versions old."""

    reason = "staleness"


def staleness_weight(kind: str, staleness: int, exponent: float = 0.5) -> float:
    """``w(s)`` of the module docstring."""
    if staleness < 0:
        raise ValueError(f"staleness {staleness} < 0: an update cannot be trained on a version not yet made")
    if kind == "constant":
        return 1.0
    if kind == "sqrt":
        return 1.0 / math.sqrt(1.0 + staleness)
    if kind == "polynomial":
        return float((1.0 + staleness) ** -exponent)
    raise ValueError(f"unknown staleness weight {kind!r}; one of {STALENESS_WEIGHTS}")


def staleness_of(sender: str, trained_on: int, current: int, max_staleness: int) -> int:
    """``current - trained_on``, or ``Stale`` naming the versions when it is beyond ``max_staleness``."""
    s = current - trained_on
    if s > max_staleness:
        raise Stale(
            f"{sender} trained on model version {trained_on}, {s} versions before the current {current}: beyond "
            f"train.max_staleness = {max_staleness}"
        )
    return s


def weighted(update: Update, weight: float) -> Update:
    """``update`` with its delta scaled by its staleness weight (a copy; the arrays it carries are not scaled)."""
    if weight == 1.0:
        return update
    return dataclasses.replace(update, delta=(update.delta * np.float32(weight)).astype(np.float32, copy=False))


def server_step(before: np.ndarray, aggregate: np.ndarray, server_lr: float) -> np.ndarray:
    """``server_lr`` of the strategy's step from ``before`` to ``aggregate`` (1: the strategy's model itself)."""
    if server_lr == 1.0:
        return aggregate
    return (before + np.float32(server_lr) * (aggregate - before)).astype(np.float32, copy=False)
