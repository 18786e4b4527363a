"""A round's uploads, for the algorithms that can weight them only when all are in (TACO's alphas of eq. 7, FoolsGold's
similarities, DRAG's first reference, the TACO-tailored variants' alphas).

Rows are kept as the arrays that were admitted, without a copy, while the bytes they keep alive stay within a RAM
bound; the rows beyond it are copied into a memory-mapped file in the run directory, an unnamed temporary file (nothing
is left behind, even after a crash) whose pages the kernel may write out and drop under memory pressure. The file and
its mapping are reused round after round, so a steady state maps no new pages.

Passes are fused so that each row is read from memory as few times as the math allows: its norm comes from admission,
which measured it anyway (``Round.delta_norm``); on arrival the row is added to the running sum of the rows and, when
the round's reference vector is known in advance (``reference``), its dot with it is taken while it is in cache; at
the end ``scores`` visits every row once, its dot with a vector known only then and, right after, while the row is
still in cache, its scaled add into the weighted sum (a row whose score is 0 is not added).
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import IO

import numpy as np

from edge_client.algorithms.contract import vector_norm
from edge_client.wire.messages import Update
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

    def clear(self, reference: np.ndarray | None = None) -> None:
        """Forget the round's rows (the references are released at once; the spill file is kept for reuse); the next
        round's rows are dotted with ``reference`` as they arrive, when it is known before they are."""
        self.reference = reference
        self.reference_dots: list[float] = []
        self.keys: list[str] = []
        self.norms: list[float] = []
        self.rows: list[np.ndarray] = []
        self.sum = RunningMean(self.size)
        self.held = 0  # bytes kept alive in RAM
        self.spilled = 0  # rows in the file

    def __len__(self) -> int:
        return len(self.rows)

    def append(self, key: str, vector: np.ndarray, keeps_alive: int | None = None, norm: float | None = None) -> None:
        """Keep ``vector`` (``keeps_alive`` bytes in RAM, default its own size) with its ``norm`` (measured when not
        given), and fold it into the running sum and, with a ``reference``, its dot with it."""
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
        self.norms.append(vector_norm(row) if norm is None else norm)
        if self.reference is not None:
            self.reference_dots.append(float(np.dot(row, self.reference)))
        self.sum.add(row)
        self.rows.append(row)

    def __iter__(self) -> Iterator[np.ndarray]:
        return iter(self.rows)

    def mean(self) -> np.ndarray:
        """The unweighted mean of the rows."""
        return self.sum.mean()

    def scores(
        self, vector: np.ndarray, rule: Callable[[int, float], float], fold: bool = False
    ) -> tuple[np.ndarray, np.ndarray | None]:
        """``s_i = rule(i, row_i . vector)`` for every row (float64) and, with ``fold``, ``sum_i s_i row_i`` (float32).

        One visit per row, the last to arrive first: its scaled add reads it from cache right after its dot. When
        ``vector`` is this round's ``reference`` the dots were taken on arrival: only the rows with a nonzero score are
        read, once, to add them.
        """
        dots = self.reference_dots if vector is self.reference else None
        acc = np.zeros(self.size, dtype=np.float32) if fold else None
        out = np.zeros(len(self.rows))
        for i in reversed(range(len(self.rows))):  # the last rows to arrive may still be in cache
            row = self.rows[i]
            out[i] = s = rule(i, float(np.dot(row, vector)) if dots is None else dots[i])
            if acc is not None and s != 0.0:
                acc = axpy(acc, row, s)
        return out, acc

    def weighted_sum(self, coefs: Sequence[float]) -> np.ndarray:
        """``sum_i coefs_i row_i`` in float32, one read of each row with a nonzero coefficient (last rows first)."""
        acc = np.zeros(self.size, dtype=np.float32)
        for row, a in zip(reversed(self.rows), reversed(list(coefs)), strict=True):
            if a != 0.0:
                acc = axpy(acc, row, a)
        return acc
