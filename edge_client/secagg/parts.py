"""What one masked input holds: the arrays an algorithm's contract sums (``Contract.summed``: the update's ``delta``,
and SCAFFOLD's ``delta_c`` or STEM's ``v`` beside it), concatenated into one vector of ring elements, each array times
its own weight. One vector, so one mask stream per seed covers all of them and no key or nonce is used twice.

Both halves read the weights from the same assignment terms: a ``weighted`` or ``per_step`` array is multiplied by
the device's weight (its share of the round's samples, or an equal share), a ``plain`` one by ``1 / devices``; every
array's weights over a round sum to at most 1. The arrays are clipped jointly, as one vector, to the clip norm, so
each array's weighted sum stays within the ring (``edge_client.secagg.ring``) and one device moves each sum by at
most the clip norm, as differential privacy's joint clipping does (``edge_client.loop.dp``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from edge_client.secagg.ring import Ring, clip

Summed = tuple[tuple[str, str], ...]  # Contract.summed: (array, how), in the order they are masked


def part_weight(how: str, terms: Mapping[str, Any]) -> float:
    """One device's weight for an array summed ``how`` (before ``per_step``'s division by its steps)."""
    return 1.0 / terms["devices"] if how == "plain" else float(terms["weight"])


def quantise(
    ring: Ring, summed: Summed, vectors: Mapping[str, np.ndarray], terms: Mapping[str, Any], steps: int
) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """The arrays ``summed`` names as one vector of ring elements, and each array as the sum will hold it (decoded,
    without its weight: what a ``commit`` array's owner adopts). They are clipped jointly to the ring's clip norm,
    unless the ring carries noise: differential privacy clipped them to that norm before adding its noise share
    (clipping again would shrink the noise)."""
    x = np.concatenate([np.asarray(vectors[name], np.float64).ravel() for name, _ in summed])
    if not ring.noise:
        x = clip(x, ring.clip)
    parts, sent = [], {}
    for (name, how), part in zip(summed, np.split(x, len(summed)), strict=True):
        weight = part_weight(how, terms) / (max(1, steps) if how == "per_step" else 1)
        if not 0.0 <= weight <= 1.0:
            raise ValueError(f"weight {weight} of {name} outside [0, 1]")
        q = ring.encode(part * weight)
        parts.append(q)
        sent[name] = ring.decode(q) / np.float32(weight) if weight else np.zeros(part.size, np.float32)
    return np.concatenate(parts), sent


def split(total: np.ndarray, summed: Summed) -> dict[str, np.ndarray]:
    """A sum of masked inputs (or of their unmasked contents) back into its arrays."""
    return {name: part for (name, _), part in zip(summed, np.split(total, len(summed)), strict=True)}
