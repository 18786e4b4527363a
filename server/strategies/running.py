"""Running weighted sums: how an update is folded into a round's aggregate the moment it is admitted."""

from __future__ import annotations

import numpy as np

from server.strategies.common import axpy


class RunningMean:
    """``sum_i p_i s_i v_i`` with ``p_i = w_i / sum_j w_j`` over the vectors folded so far, held as the weighted sum and
    its normaliser and divided once, at the end: exact whatever the number and order of arrivals, and one vector of
    memory whatever their number.

    The weights ``w_i`` are counts (1 for uniform weights, or a client's sample count D_i), so their sum is 0 or at
    least 1; when it is 0 every weight was 0 and the weights are uniform (C3, C5's fallback): the vectors of weight 0
    are summed apart, in a second vector allocated only when one arrives. ``s_i`` is a factor of the vector known when
    it arrives (FedNova's ``1/tau_i``). Float32 sums, as the aggregation always was: the last bits of the result
    depend on the order in which updates arrive.
    """

    def __init__(self, size: int) -> None:
        self.total = np.zeros(size, dtype=np.float32)  # sum of w_i s_i v_i over the positive weights
        self.weight = 0.0  # sum of w_i
        self.count = 0
        self._zero: np.ndarray | None = None  # sum of s_i v_i over the weights that are 0

    def add(self, vector: np.ndarray, weight: float = 1.0, scale: float = 1.0) -> None:
        if weight < 0:
            raise ValueError(f"a fold weight is a count, never negative: got {weight}")
        if weight > 0:
            self.total = axpy(self.total, vector, weight * scale)
        else:
            self._zero = axpy(np.zeros_like(self.total) if self._zero is None else self._zero, vector, scale)
        self.weight += weight
        self.count += 1

    def mean(self) -> np.ndarray:
        """``sum_i p_i s_i v_i`` (a new array)."""
        if self.count == 0:
            raise ValueError("nothing was folded")
        if self.weight > 0:
            return self.total / np.float32(self.weight)
        assert self._zero is not None  # every weight was 0
        return self._zero / np.float32(self.count)
