"""A round's uploads, for the algorithms that can weight them only when all are in (TACO's alphas of eq. 7, FoolsGold's
similarities, DRAG's first reference, the TACO-tailored variants' alphas).

Rows are kept as the arrays that were admitted, without a copy, while the bytes they keep alive stay within a RAM
bound; the rows beyond it are copied into a memory-mapped file in the run directory, an unnamed temporary file (nothing
is left behind, even after a crash) whose pages the kernel may write out and drop under memory pressure. The file and
its mapping are reused round after round, so a steady state maps no new pages.

Passes are fused so that each row is read from memory as few times as the math allows: when a row arrives its norm and
the running sum of the rows are taken while it is in cache; at the end ``dots`` reads every row once (forwards) and
``weighted_sum`` once more (backwards, so the rows read last are still in cache), skipping rows whose coefficient is 0.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import IO

import numpy as np

from edge_client.protocol import Update
from server.strategies.common import axpy
from server.strategies.running import RunningMean

#: Bytes of admitted arrays a store keeps in RAM before it spills rows to its file (256 updates of 1M parameters).
DEFAULT_RAM_BYTES = 1 << 30
_FIRST_SPILL_ROWS = 8


def held_bytes(update: Update) -> int:
    """The bytes a kept ``delta`` may keep alive: a decoded message's arrays are views into one payload."""
    return update.delta.nbytes + sum(a.nbytes for a in update.arrays.values())


class _SpillFile:
    """Row slots of ``size`` float32 in an unnamed file in ``directory``, mapped in segments that double in size."""

    def __init__(self, size: int, directory: Path | None) -> None:
        self.size = size
        # open as long as the store lives (its mapping is reused every round); unnamed, so closing is not cleanup
        self.file: IO[bytes] = tempfile.TemporaryFile(prefix="edgefl-round-rows-", dir=directory)  # noqa: SIM115
        self.slots: list[np.ndarray] = []

    def slot(self, index: int) -> np.ndarray:
        while index >= len(self.slots):
            rows = max(_FIRST_SPILL_ROWS, len(self.slots))
            row_bytes = 4 * self.size
            offset = len(self.slots) * row_bytes
            self.file.truncate(offset + rows * row_bytes)
            segment = np.memmap(self.file, dtype=np.float32, mode="r+", offset=offset, shape=(rows, self.size))
            self.slots.extend(segment)
        return self.slots[index]


class UpdateStore:
    """The rows of one round (``clear`` before the next), their keys and norms, and their uniform running sum."""

    def __init__(self, size: int, spill_dir: Path | None = None, ram_bytes: int = DEFAULT_RAM_BYTES) -> None:
        self.size = size
        self.spill_dir = spill_dir
        self.ram_bytes = ram_bytes
        self._spill: _SpillFile | None = None
        self.clear()

    def clear(self) -> None:
        """Forget the round's rows (the references are released at once; the spill file is kept for reuse)."""
        self.keys: list[str] = []
        self.norms: list[float] = []
        self.rows: list[np.ndarray] = []
        self.sum = RunningMean(self.size)
        self.held = 0  # bytes kept alive in RAM
        self.spilled = 0  # rows in the file

    def __len__(self) -> int:
        return len(self.rows)

    def append(self, key: str, vector: np.ndarray, keeps_alive: int | None = None) -> None:
        """Keep ``vector`` (``keeps_alive`` bytes in RAM, default its own size) and fold its norm and running sum."""
        need = vector.nbytes if keeps_alive is None else keeps_alive
        if self.held + need <= self.ram_bytes:
            row = np.asarray(vector, dtype=np.float32).view()
            row.flags.writeable = False  # a view of what the client sent: never written through
            self.held += need
        else:
            if self._spill is None:
                self._spill = _SpillFile(self.size, self.spill_dir)
            row = self._spill.slot(self.spilled)
            np.copyto(row, vector)
            self.spilled += 1
        self.keys.append(key)
        self.norms.append(float(np.linalg.norm(row)))
        self.sum.add(row)
        self.rows.append(row)

    def __iter__(self) -> Iterator[np.ndarray]:
        return iter(self.rows)

    def mean(self) -> np.ndarray:
        """The unweighted mean of the rows."""
        return self.sum.mean()

    def dots(self, vector: np.ndarray) -> np.ndarray:
        """``row_i . vector`` for every row (float64), one read of each row."""
        return np.array([float(np.dot(row, vector)) for row in self.rows])

    def weighted_sum(self, coefs: Sequence[float]) -> np.ndarray:
        """``sum_i coefs_i row_i`` in float32, one read of each row with a nonzero coefficient (last rows first)."""
        acc = np.zeros(self.size, dtype=np.float32)
        for row, a in zip(reversed(self.rows), reversed(list(coefs)), strict=True):
            if a != 0.0:
                acc = axpy(acc, row, a)
        return acc
