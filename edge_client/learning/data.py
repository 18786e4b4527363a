"""A device's own training data: in-memory arrays, loaders for npz / MNIST-style idx / CSV files, the held-out
split a device evaluates on, batch sampling.

Only numpy and the standard library: this runs on the device, and nothing is ever downloaded.
"""

from __future__ import annotations

import csv
import gzip
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

__all__ = [
    "ArrayDataset",
    "BatchSampler",
    "load_csv",
    "load_idx_pair",
    "load_local_data",
    "prepare_images",
    "read_idx",
    "split_holdout",
]

ACCEPTED_FORMATS = (
    "an .npz file with arrays x and y (or x_train and y_train), a .csv file of numeric columns with a header "
    "(and --label-column NAME), or a directory holding exactly one such .npz or MNIST-style idx files "
    "(train-images-idx3-ubyte[.gz] + train-labels-idx1-ubyte[.gz])"
)


@dataclass
class ArrayDataset:
    """Features and targets held in memory; x is (N, C, H, W) for images or (N, F) for tabular data.

    Integer-valued targets (class ids, 0/1 labels) are kept as int64, any others (regression) as float32; y is (N,)
    or (N, K). Whether they fit the run's task is the task's to say (``edge_client.learning.tasks``).
    """

    x: np.ndarray
    y: np.ndarray

    def __post_init__(self) -> None:
        self.x = np.ascontiguousarray(self.x, dtype=np.float32)
        y = np.asarray(self.y)
        if y.ndim not in (1, 2):
            raise ValueError(f"targets y must be (N,) or (N, K), got shape {y.shape}")
        if not (np.issubdtype(y.dtype, np.number) or y.dtype == np.bool_):
            raise ValueError(f"targets y must be numbers, got dtype {y.dtype}")
        if np.issubdtype(y.dtype, np.floating) and not np.isfinite(y).all():
            raise ValueError("targets y contain NaN or infinite values")
        integral = not np.issubdtype(y.dtype, np.floating) or bool(np.all(np.mod(y, 1) == 0))
        self.y = np.ascontiguousarray(y, dtype=np.int64 if integral else np.float32)
        if self.x.ndim < 2:
            raise ValueError(f"x must be (N, F) or (N, C, H, W), got shape {self.x.shape}")
        if len(self.x) != len(self.y):
            raise ValueError(f"x and y must have the same length N (x {self.x.shape}, y {self.y.shape})")

    def __len__(self) -> int:
        return len(self.y)

    def subset(self, idx: np.ndarray) -> ArrayDataset:
        return ArrayDataset(self.x[idx], self.y[idx])


def split_holdout(data: ArrayDataset, fraction: float, seed: int, client_id: str) -> tuple[ArrayDataset, ArrayDataset]:
    """``(train, held out)``: a seeded share of the samples kept for federated evaluation, never trained on.

    Seeded from (seed, crc32(client_id)) like the batch stream, so a device holds out the same samples on every start.
    """
    if not 0.0 < fraction < 1.0:
        raise ValueError(f"--holdout must be a fraction in (0, 1), got {fraction}")
    n_out = round(fraction * len(data))
    if n_out < 1 or n_out >= len(data):
        raise ValueError(f"--holdout {fraction} of {len(data)} samples leaves no validation or no training sample")
    rng = np.random.default_rng([int(seed) & 0xFFFFFFFF, zlib.crc32(client_id.encode("utf-8"))])
    perm = rng.permutation(len(data))
    return data.subset(np.sort(perm[n_out:])), data.subset(np.sort(perm[:n_out]))


def load_csv(path: str | Path, label_column: str) -> ArrayDataset:
    """A CSV file with a header row: every column a number, ``label_column`` the target, the others the features.

    Read with the standard library and numpy only; an error names the row (the file's line number) and the column.
    """
    path = Path(path)
    with open(path, newline="") as fh:
        rows = list(csv.reader(fh))
    if not rows:
        raise ValueError(f"{path}: empty file; expected a header row naming the columns")
    header = [h.strip() for h in rows[0]]
    if label_column not in header:
        raise ValueError(f"{path}: no column {label_column!r} for --label-column; the columns are {', '.join(header)}")
    body = [r for r in rows[1:] if r]
    line_of = [i + 2 for i, r in enumerate(rows[1:]) if r]  # 1-based, after the header
    if not body:
        raise ValueError(f"{path}: a header but no data rows")
    for line, row in zip(line_of, body, strict=True):
        if len(row) != len(header):
            raise ValueError(f"{path}: row {line} has {len(row)} cells, the header {len(header)}")
    cells = np.array(body, dtype=str)
    try:
        values = cells.astype(np.float64)
    except ValueError:
        for (r, c), cell in np.ndenumerate(cells):
            try:
                float(cell)
            except ValueError:
                raise ValueError(
                    f"{path}: row {line_of[r]}, column {header[c]!r}: {str(cell)!r} is not a number"
                ) from None
        raise
    bad = ~np.isfinite(values)
    if bad.any():
        r, c = np.argwhere(bad)[0]
        raise ValueError(f"{path}: row {line_of[r]}, column {header[c]!r}: {str(cells[r, c])!r} is not a finite number")
    label = header.index(label_column)
    return ArrayDataset(np.delete(values, label, axis=1).astype(np.float32), values[:, label])


def prepare_images(x: np.ndarray) -> np.ndarray:
    """uint8 (N,H,W) or (N,C,H,W) -> float32 (N,C,H,W) in [0, 1]; float input is taken as already prepared."""
    x = np.asarray(x)
    if x.ndim == 3:
        x = x[:, None, :, :]
    if x.dtype == np.uint8:
        return (x.astype(np.float32) / np.float32(255.0)).astype(np.float32, copy=False)
    return x.astype(np.float32, copy=False)


_IDX_DTYPES = {0x08: ">u1", 0x09: ">i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}


def read_idx(path: str | Path) -> np.ndarray:
    """Parse an idx file (MNIST format, optionally gzipped) with numpy; the magic number is checked."""
    path = Path(path)
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "rb") as fh:
        raw = fh.read()
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] not in _IDX_DTYPES or raw[3] == 0:
        raise ValueError(f"{path}: not an idx file (bad magic number {raw[:4].hex()})")
    dtype, ndim = np.dtype(_IDX_DTYPES[raw[2]]), raw[3]
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise ValueError(f"{path}: truncated idx header")
    shape = tuple(int(d) for d in np.frombuffer(raw, ">u4", count=ndim, offset=4))
    count = int(np.prod(shape)) if shape else 0
    if len(raw) - header != count * dtype.itemsize:
        raise ValueError(f"{path}: idx data size {len(raw) - header} bytes does not match shape {shape}")
    return np.frombuffer(raw, dtype, count=count, offset=header).reshape(shape).astype(dtype.newbyteorder("="))


def _find_idx(directory: Path, prefixes: tuple[str, ...], kind: str) -> Path | None:
    """The single idx file ``<prefix>-<kind>-idx?-ubyte[.gz]`` in directory, None if absent, error if ambiguous."""
    hits = sorted(
        p
        for p in directory.iterdir()
        if p.is_file()
        and any(p.name.startswith(f"{pre}-{kind}-idx") for pre in prefixes)
        and (p.name.endswith("-ubyte") or p.name.endswith("-ubyte.gz"))
    )
    if len(hits) > 1:
        raise ValueError(f"{directory}: more than one {kind} idx file ({', '.join(p.name for p in hits)}); keep one")
    return hits[0] if hits else None


def load_idx_pair(directory: Path, prefixes: tuple[str, ...]) -> ArrayDataset | None:
    """Images + labels idx files with one of the given name prefixes, or None when neither exists."""
    images, labels = _find_idx(directory, prefixes, "images"), _find_idx(directory, prefixes, "labels")
    if images is None and labels is None:
        return None
    if images is None or labels is None:
        missing = "images" if images is None else "labels"
        raise FileNotFoundError(f"{directory}: found {(labels or images).name} but no matching {missing} idx file")
    return ArrayDataset(prepare_images(read_idx(images)), read_idx(labels))


def _load_npz(path: Path) -> ArrayDataset:
    with np.load(path, allow_pickle=False) as z:
        for xk, yk in (("x", "y"), ("x_train", "y_train")):
            if xk in z and yk in z:
                x = z[xk]
                return ArrayDataset(prepare_images(x) if x.dtype == np.uint8 else x, z[yk])
        keys = ", ".join(z.files)
    raise ValueError(f"{path}: npz has arrays [{keys}] but needs x and y (or x_train and y_train)")


def load_local_data(path: str | Path, label_column: str | None = None) -> ArrayDataset:
    """Load a device's own data from an npz or CSV file or a directory (one npz, or idx files); see ACCEPTED_FORMATS."""
    path = Path(path).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"data path {path} does not exist; expected {ACCEPTED_FORMATS}")
    if path.suffix == ".csv":
        if not label_column:
            raise ValueError(f"{path}: a CSV file needs --label-column NAME (the column holding the target)")
        return load_csv(path, label_column)
    if label_column:
        raise ValueError(f"--label-column applies to .csv files; {path} is not one")
    if path.is_file():
        if path.suffix != ".npz":
            raise ValueError(f"{path}: unsupported file type; expected {ACCEPTED_FORMATS}")
        return _load_npz(path)
    npz = sorted(p for p in path.iterdir() if p.is_file() and p.suffix == ".npz")
    if len(npz) > 1:
        raise ValueError(f"{path}: more than one .npz file ({', '.join(p.name for p in npz)}); pass the file itself")
    if npz:
        return _load_npz(npz[0])
    # Any "<prefix>-images-idx*" pattern is accepted, but train-* wins when test files sit next to it.
    data = load_idx_pair(path, ("train",))
    if data is None:
        prefixes = {p.name.split("-images-idx")[0] for p in path.iterdir() if "-images-idx" in p.name}
        if len(prefixes) > 1:
            raise ValueError(f"{path}: idx files with several prefixes ({', '.join(sorted(prefixes))}); keep one set")
        data = load_idx_pair(path, tuple(prefixes)) if prefixes else None
    if data is None:
        raise FileNotFoundError(f"{path}: no data found; expected {ACCEPTED_FORMATS}")
    return data


class BatchSampler:
    """Mini-batch indices for K local *steps* (ALGORITHMS.md C4): an endless per-client stream of permutations.

    The stream is seeded from (seed, crc32(client_id)) so it is reproducible across processes (unlike ``hash()``)
    and independent between clients.
    """

    def __init__(self, n: int, batch_size: int, seed: int, client_id: str) -> None:
        if n <= 0:
            raise ValueError(f"BatchSampler needs at least one sample, got n={n}")
        if batch_size <= 0:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        self.n, self.batch_size = n, min(batch_size, n)
        self._rng = np.random.default_rng([int(seed) & 0xFFFFFFFF, zlib.crc32(client_id.encode("utf-8"))])
        self._perm = self._rng.permutation(n)
        self._pos = 0

    def next(self) -> np.ndarray:
        """The next ``min(batch_size, n)`` indices: consecutive slices of a concatenation of permutations.

        Batches keep a constant size (a batch may straddle two permutations), and each permutation, i.e. each
        epoch of the stream, holds every index exactly once.
        """
        parts, need = [], self.batch_size
        while need:
            if self._pos == self.n:
                self._perm, self._pos = self._rng.permutation(self.n), 0
            take = min(need, self.n - self._pos)
            parts.append(self._perm[self._pos : self._pos + take])
            self._pos += take
            need -= take
        return parts[0] if len(parts) == 1 else np.concatenate(parts)
