"""A newcomer's own data in simulate (issue 25): a CSV file as devices read it, its features standardised by the
training split, a factory model's input shape from the data set, and devices that evaluate when told to. The same
through `edge-server simulate` and client processes: tests/integration/test_your_data.py."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from edge_client.learning.data import load_local_data
from edge_client.learning.predictor import sample_shape_for
from edgefl_testkit.federation import make_config
from edgefl_testkit.own import write_csv
from server.assembly import model_spec
from server.cli import build_parser
from server.config import from_dict
from server.datasets import MAX_STAT_FEATURES, feature_stats, load_dataset
from server.target import DEFAULT_DEVICE_HOLDOUT, simulated_holdout


def test_a_csv_data_set_is_split_and_standardised_by_its_training_rows(tmp_path: Path) -> None:
    write_csv(tmp_path / "all.csv")
    b = load_dataset(str(tmp_path / "all.csv"), seed=3, label_column="label")
    assert (len(b.train), len(b.test), b.num_classes) == (240, 60, 2)
    np.testing.assert_allclose(b.input_stats["input_mean"], b.train.x.mean(axis=0), rtol=1e-5)
    np.testing.assert_allclose(b.input_stats["input_std"], b.train.x.std(axis=0), rtol=1e-5)
    assert b.model == {"name": "mlp", "in_features": 2, "num_classes": 2, **b.input_stats}
    other = load_dataset(str(tmp_path / "all.csv"), seed=4, label_column="label")
    assert not np.array_equal(b.test.x, other.test.x)  # the split follows the run's seed
    with pytest.raises(ValueError, match=r"data.label_column \(--label-column NAME\)"):
        load_dataset(str(tmp_path / "all.csv"))
    with pytest.raises(ValueError, match=r"no column 'y'.*income, ratio, label"):
        load_dataset(str(tmp_path / "all.csv"), label_column="y")


def test_wide_data_gets_one_mean_and_std_that_fit_a_message_header() -> None:
    x = np.random.default_rng(0).normal(3.0, 2.0, (20, MAX_STAT_FEATURES + 1)).astype(np.float32)
    stats = feature_stats(x)
    assert stats == {"input_mean": pytest.approx(x.mean()), "input_std": pytest.approx(x.std())}
    assert len(feature_stats(x[:, :MAX_STAT_FEATURES])["input_std"]) == MAX_STAT_FEATURES


def test_partition_writes_device_shards_of_a_csv_file(tmp_path: Path) -> None:
    """``edge-server partition --dataset all.csv --label-column label``: one .npz per device of the training rows."""
    write_csv(tmp_path / "all.csv")
    args = build_parser().parse_args(["partition", "--dataset", str(tmp_path / "all.csv"), "--label-column", "label",
                                      "--clients", "2", "--out", str(tmp_path / "shards")])  # fmt: skip
    assert args.func(args) == 0
    assert sum(len(load_local_data(tmp_path / "shards" / f"client-0{i}.npz")) for i in range(2)) == 240


def test_a_factory_models_input_shape_comes_from_the_data_set(tmp_path: Path) -> None:
    x = np.zeros((8, 3), np.float32)
    np.savez(tmp_path / "d.npz", x_train=x, y_train=np.arange(8) % 2, x_test=x[:2], y_test=[0, 1])
    bundle = load_dataset(str(tmp_path / "d.npz"))
    config = make_config(tmp_path, "shape", 2, 1, dataset=str(tmp_path / "d.npz"), model={"factory": "m:build"})
    spec = model_spec(config, bundle)
    assert spec["input_shape"] == [3] and sample_shape_for(spec) == (3,)
    configured = make_config(tmp_path, "shape", 2, 1, model={"factory": "m:build", "input_shape": [1, 3]})
    assert model_spec(configured, bundle)["input_shape"] == [1, 3]  # what the configuration says wins


def test_devices_hold_out_a_split_when_they_evaluate() -> None:
    def holdout(**section: object) -> float:
        return simulated_holdout(from_dict({"eval": section}))

    assert holdout(mode="clients") == holdout(mode="both") == DEFAULT_DEVICE_HOLDOUT
    assert holdout(mode="clients", holdout=0.3) == 0.3
    assert holdout() == holdout(mode="server") == 0.0  # the server's test set evaluates: devices train on it all
