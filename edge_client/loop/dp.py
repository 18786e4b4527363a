"""The device's half of differential privacy (docs/privacy.md): clip everything it uploads to the clip norm the
server sent, and add the Gaussian noise it was told to add, before any upload codec sees the update.

Clipping is joint: the update's ``delta`` and the contract's returned arrays (SCAFFOLD's ``delta_c``, STEM's ``v``)
are one vector of L2 norm at most ``dp_clip_norm``, so one device moves the sum of each by at most that much. The
noise comes from numpy's PCG64 seeded with 128 bits of ``secrets`` (the operating system's CSPRNG), a fresh
generator per round: numpy and the standard library only, as the device runtime requires.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Mapping
from typing import Any

import numpy as np

from edge_client.algorithms.contract import vector_norm

#: Clipping scales by ``C / norm`` times this, so float32 rounding never leaves a clipped update above ``C``.
CLIP_MARGIN = 1.0 - 1e-5


def noise_rng() -> np.random.Generator:
    """A generator seeded from the operating system's CSPRNG (``secrets``): what both halves draw noise from."""
    return np.random.default_rng(secrets.randbits(128))


def noise_std(settings: Mapping[str, Any]) -> float:
    """The std of the Gaussian noise the plan's settings tell the device to add (0: none)."""
    return float(settings.get("dp_noise_std", 0.0))


def privatize(
    settings: Mapping[str, Any], delta: np.ndarray, arrays: dict[str, np.ndarray]
) -> tuple[np.ndarray, dict[str, np.ndarray], dict[str, int]]:
    """``delta`` and ``arrays`` clipped jointly and noised as the plan's settings say (new vectors: an algorithm may
    keep the arrays it returned), and the value to send back (``dp_within``: the upload was within the clip norm
    before clipping); all unchanged, and no value, without DP."""
    clip = settings.get("dp_clip_norm")
    if clip is None:
        return delta, arrays, {}
    names = ["", *arrays]
    vectors = [delta, *arrays.values()]
    norm = math.sqrt(sum(vector_norm(v) ** 2 for v in vectors))
    if not math.isfinite(norm):
        raise ValueError("the update is not finite; nothing to clip")
    scale = np.float32(clip / norm * CLIP_MARGIN if norm > clip else 1.0)
    out = [v * scale for v in vectors]
    std = noise_std(settings)
    if std > 0:
        rng = noise_rng()
        for v in out:
            v += rng.normal(0.0, std, v.shape).astype(np.float32)
    return out[0], dict(zip(names[1:], out[1:], strict=True)), {"dp_within": int(norm <= clip)}
