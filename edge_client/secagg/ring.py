"""The fixed-point ring a masked update lives in: integers modulo 2^bits (bits <= 32, carried as uint32).

A device clips its update to ``clip`` (L2 norm), multiplies it by its weight (its share of the round's samples, so the
weights of a round sum to at most 1) and rounds ``scale`` times it to integers. Each coordinate of the weighted sum is
then at most ``clip`` in magnitude, and with ``scale = (2^(bits-1) - devices) / clip`` its integer sum, rounding
included, stays inside the ring's signed range: the sum of clipped values cannot wrap.

With differential privacy's noise shares (``noise``: the std each device adds to its clipped update, docs/privacy.md)
the range is ``clip + NOISE_SIGMAS * noise``: the weighted sum's noise has a std of at most ``noise`` per coordinate
(the squares of weights that sum to at most 1 sum to at most 1), and a Gaussian beyond 10 of its std has probability
2e-23 per coordinate.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

MIN_BITS, MAX_BITS = 16, 32
NOISE_SIGMAS = 10.0  # the ring's headroom for the noise shares, in their std


@dataclass(frozen=True)
class Ring:
    bits: int
    clip: float
    devices: int  # the most devices whose inputs are summed in it (the round's selected devices)
    noise: float = 0.0  # the std of the noise share each device adds after clipping (0: none)

    def __post_init__(self) -> None:
        if not MIN_BITS <= self.bits <= MAX_BITS:
            raise ValueError(f"quantisation bits {self.bits} outside [{MIN_BITS}, {MAX_BITS}]")
        if not self.clip > 0:
            raise ValueError(f"clip norm {self.clip} must be > 0")
        if not 1 <= self.devices < 2 ** (self.bits - 2):
            raise ValueError(f"{self.devices} devices do not fit a {self.bits}-bit ring")
        if not 0 <= self.noise < float("inf"):
            raise ValueError(f"noise std {self.noise} must be finite and >= 0")

    @property
    def mask(self) -> int:
        return (1 << self.bits) - 1

    @property
    def range(self) -> float:
        """The largest magnitude a coordinate of the weighted sum takes (with the noise: but for 2e-23)."""
        return self.clip + NOISE_SIGMAS * self.noise

    @property
    def scale(self) -> float:
        return (2 ** (self.bits - 1) - self.devices) / self.range

    def quantise(self, x: np.ndarray, weight: float) -> np.ndarray:
        """``x`` clipped to norm ``clip``, times ``weight`` (in [0, 1]), as ring elements."""
        if not 0.0 <= weight <= 1.0:
            raise ValueError(f"weight {weight} outside [0, 1]")
        return self.encode(clip(x, self.clip) * weight)

    def encode(self, x: np.ndarray) -> np.ndarray:
        """Round ``scale * x`` to integers, as ring elements (two's complement modulo 2^bits)."""
        q = np.rint(np.asarray(x, np.float64) * self.scale).astype(np.int64)
        return (q & self.mask).astype(np.uint32)

    def add(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        return (a + b) & np.uint32(self.mask)  # uint32 wraps modulo 2^32; the mask takes a smaller ring's modulus

    def sub(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        return (a - b) & np.uint32(self.mask)

    def signed(self, s: np.ndarray) -> np.ndarray:
        """Ring elements as signed integers (the upper half negative)."""
        v = s.astype(np.int64) & self.mask
        return np.where(v >= 1 << (self.bits - 1), v - (1 << self.bits), v)

    def decode(self, s: np.ndarray) -> np.ndarray:
        """A sum of ring elements back to float32 (within ``devices / 2 / scale`` of the float sum)."""
        return (self.signed(s) / self.scale).astype(np.float32)


def clip(x: np.ndarray, bound: float) -> np.ndarray:
    """``x`` scaled down to L2 norm ``bound`` when above it (float64: the norm of a large vector stays exact)."""
    x = np.asarray(x, np.float64)
    norm = float(np.linalg.norm(x))
    return x * (bound / norm) if norm > bound else x
