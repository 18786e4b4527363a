import gzip
import struct

import numpy as np
import pytest

from edge_client.learning.data import ArrayDataset, BatchSampler, load_local_data, prepare_images, read_idx


def write_idx(path, array: np.ndarray, compress: bool) -> None:
    codes = {np.dtype(np.uint8): 0x08, np.dtype(">i4"): 0x0C}
    header = struct.pack(">BBBB", 0, 0, codes[array.dtype], array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    with (gzip.open if compress else open)(path, "wb") as fh:
        fh.write(header + array.tobytes())


def images_labels(n=7, side=5, seed=0):
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, (n, side, side), dtype=np.uint8), rng.integers(0, 10, n, dtype=np.uint8)


def test_array_dataset_converts_and_validates():
    ds = ArrayDataset(np.zeros((3, 2), np.float64), np.array([0, 1, 2], np.int32))
    assert ds.x.dtype == np.float32 and ds.y.dtype == np.int64 and len(ds) == 3
    with pytest.raises(ValueError, match="same length"):
        ArrayDataset(np.zeros((3, 2)), np.zeros(2))
    regression = ArrayDataset(np.zeros((2, 2)), np.array([0.5, -1.0]))  # any number: the task judges targets
    assert regression.y.dtype == np.float32
    with pytest.raises(ValueError, match="numbers"):
        ArrayDataset(np.zeros((2, 2)), np.array(["a", "b"]))
    with pytest.raises(ValueError, match="NaN"):
        ArrayDataset(np.zeros((2, 2)), np.array([0.5, np.nan]))


def test_prepare_images():
    x = np.array([[[0, 255]]], np.uint8)
    out = prepare_images(x)
    assert out.shape == (1, 1, 1, 2) and out.dtype == np.float32
    np.testing.assert_array_equal(out.ravel(), [0.0, 1.0])
    already = np.full((2, 3, 4, 4), 0.5, np.float32)
    np.testing.assert_array_equal(prepare_images(already), already)


@pytest.mark.parametrize("compress", [False, True])
def test_idx_round_trip(tmp_path, compress):
    x, y = images_labels()
    ext = ".gz" if compress else ""
    write_idx(tmp_path / f"train-images-idx3-ubyte{ext}", x, compress)
    write_idx(tmp_path / f"train-labels-idx1-ubyte{ext}", y, compress)
    np.testing.assert_array_equal(read_idx(tmp_path / f"train-images-idx3-ubyte{ext}"), x)
    ds = load_local_data(tmp_path)
    assert ds.x.shape == (7, 1, 5, 5)
    np.testing.assert_allclose(ds.x[:, 0], x / 255.0, rtol=1e-6)
    np.testing.assert_array_equal(ds.y, y)


def test_idx_other_prefix_and_int32(tmp_path):
    x, y = images_labels()
    write_idx(tmp_path / "client3-images-idx3-ubyte", x, False)
    write_idx(tmp_path / "client3-labels-idx1-ubyte", y.astype(">i4"), False)
    np.testing.assert_array_equal(load_local_data(tmp_path).y, y)


def test_idx_bad_magic(tmp_path):
    (tmp_path / "f").write_bytes(b"\x01\x02\x08\x01" + b"\x00" * 8)
    with pytest.raises(ValueError, match="magic"):
        read_idx(tmp_path / "f")
    x, _ = images_labels()
    write_idx(tmp_path / "g", x, False)
    (tmp_path / "h").write_bytes((tmp_path / "g").read_bytes()[:-1])
    with pytest.raises(ValueError, match="size"):
        read_idx(tmp_path / "h")


@pytest.mark.parametrize(("xk", "yk"), [("x", "y"), ("x_train", "y_train")])
def test_npz_round_trip(tmp_path, xk, yk):
    x = np.random.default_rng(0).normal(size=(6, 4)).astype(np.float32)
    y = np.arange(6) % 3
    np.savez(tmp_path / "mine.npz", **{xk: x, yk: y})
    for path in (tmp_path / "mine.npz", tmp_path):
        ds = load_local_data(path)
        np.testing.assert_array_equal(ds.x, x)
        np.testing.assert_array_equal(ds.y, y)


def test_npz_uint8_images_are_prepared(tmp_path):
    x, y = images_labels()
    np.savez(tmp_path / "d.npz", x=x, y=y)
    ds = load_local_data(tmp_path / "d.npz")
    assert ds.x.shape == (7, 1, 5, 5) and ds.x.max() <= 1.0


def test_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="npz"):
        load_local_data(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="idx"):
        load_local_data(tmp_path)  # empty directory: says what it looked for
    (tmp_path / "notes.txt").write_text("hi")
    with pytest.raises(ValueError, match="npz"):
        load_local_data(tmp_path / "notes.txt")
    np.savez(tmp_path / "a.npz", x=np.zeros((2, 2)), y=np.zeros(2))
    np.savez(tmp_path / "b.npz", x=np.zeros((2, 2)), y=np.zeros(2))
    with pytest.raises(ValueError, match="more than one"):
        load_local_data(tmp_path)
    np.savez(tmp_path / "c.npz", features=np.zeros((2, 2)))
    with pytest.raises(ValueError, match="x and y"):
        load_local_data(tmp_path / "c.npz")


def test_idx_errors(tmp_path):
    x, y = images_labels()
    write_idx(tmp_path / "train-images-idx3-ubyte", x, False)
    with pytest.raises(FileNotFoundError, match="labels"):
        load_local_data(tmp_path)
    write_idx(tmp_path / "train-labels-idx1-ubyte", y, False)
    write_idx(tmp_path / "train-labels-idx1-ubyte.gz", y, True)
    with pytest.raises(ValueError, match="more than one"):
        load_local_data(tmp_path)


def test_idx_ambiguous_prefixes(tmp_path):
    x, y = images_labels()
    for prefix in ("a", "b"):
        write_idx(tmp_path / f"{prefix}-images-idx3-ubyte", x, False)
        write_idx(tmp_path / f"{prefix}-labels-idx1-ubyte", y, False)
    with pytest.raises(ValueError, match="several prefixes"):
        load_local_data(tmp_path)


@pytest.mark.parametrize(("n", "bs"), [(10, 3), (12, 4), (5, 8)])
def test_batch_sampler_epochs(n, bs):
    sampler = BatchSampler(n, bs, seed=1, client_id="pi-01")
    batches = [sampler.next() for _ in range(4 * n)]
    assert all(len(b) == min(bs, n) for b in batches)
    stream = np.concatenate(batches)
    for epoch in range(len(stream) // n):
        assert sorted(stream[epoch * n : (epoch + 1) * n]) == list(range(n))
    assert not np.array_equal(stream[:n], stream[n : 2 * n]) or n < 3


def test_batch_sampler_deterministic_per_client():
    def stream(seed, cid):
        s = BatchSampler(100, 10, seed, cid)
        return np.concatenate([s.next() for _ in range(25)])

    np.testing.assert_array_equal(stream(7, "pi-01"), stream(7, "pi-01"))
    assert not np.array_equal(stream(7, "pi-01"), stream(7, "pi-02"))
    assert not np.array_equal(stream(7, "pi-01"), stream(8, "pi-01"))


def test_batch_sampler_rejects_bad_args():
    with pytest.raises(ValueError):
        BatchSampler(0, 4, 0, "a")
    with pytest.raises(ValueError):
        BatchSampler(4, 0, 0, "a")
