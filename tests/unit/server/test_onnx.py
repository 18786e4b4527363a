"""ONNX export (server.onnx_export) and onnxruntime inference (edge_client.learning.predictor) for the shipped
models."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from edge_client.learning.models import MODELS, build_model, get_flat
from edge_client.learning.predictor import Predictor, sidecar_path, softmax
from edge_client.learning.tasks import predicted_labels
from server.onnx_export import export_onnx, sample_shape_for

REPO = Path(__file__).resolve().parents[3]
SPECS: dict[str, dict[str, Any]] = {
    "cnn-28x28x1": {"name": "cnn", "in_channels": 1, "num_classes": 10, "image_size": 28},
    "cnn-32x32x3": {"name": "cnn", "in_channels": 3, "num_classes": 10, "image_size": 32},
    "mlp-digits": {"name": "mlp", "in_features": 64, "num_classes": 10},
    "fedveca-cnn-28x28x1": {"name": "fedveca-cnn", "in_channels": 1, "num_classes": 10, "image_size": 28},
    # the input standardisation (a forward pre-hook) must be traced into the export: one value, and per channel
    "cnn-28x28x1-std": {"name": "cnn", "in_channels": 1, "num_classes": 10, "image_size": 28, "input_mean": 0.13,
                        "input_std": 0.31},
    "cnn-32x32x3-std": {"name": "cnn", "in_channels": 3, "num_classes": 10, "image_size": 32,
                        "input_mean": [0.5, 0.4, 0.3], "input_std": [0.2, 0.25, 0.3]},
}  # fmt: skip
SHAPES = {
    "cnn-28x28x1": (1, 28, 28),
    "cnn-32x32x3": (3, 32, 32),
    "mlp-digits": (64,),
    "fedveca-cnn-28x28x1": (1, 28, 28),
    "cnn-28x28x1-std": (1, 28, 28),
    "cnn-32x32x3-std": (3, 32, 32),
}
# Models whose outputs are not 10-class logits of real-valued inputs: their own parity test below.
OTHER_SPECS = {
    "svm": {"name": "svm", "in_features": 784},
    "char-lstm": {"name": "char-lstm"},
}


def random_model(spec: dict[str, Any], seed: int) -> tuple[torch.nn.Module, np.ndarray]:
    """The model at a seeded random initialisation (torch's own, so logits have a realistic scale)."""
    torch.manual_seed(seed)
    model = build_model(spec).eval()
    return model, get_flat(model)


@pytest.fixture(scope="module", params=sorted(SPECS))
def exported(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    key = request.param
    spec = SPECS[key]
    model, weights = random_model(spec, seed=len(key))
    path = tmp_path_factory.mktemp(key.replace("x", "_")) / "model.onnx"
    returned = export_onnx(spec, weights, path, sample_shape=sample_shape_for(spec), round=7)
    return {"key": key, "spec": spec, "model": model, "weights": weights, "path": path, "returned": returned}


def torch_logits(model: torch.nn.Module, x: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.from_numpy(x)).numpy()


def test_every_shipped_model_is_covered() -> None:
    assert {spec["name"] for spec in [*SPECS.values(), *OTHER_SPECS.values()]} == set(MODELS)


def test_sample_shape_for_the_shipped_models() -> None:
    for key, spec in SPECS.items():
        assert sample_shape_for(spec) == SHAPES[key]
    assert sample_shape_for(OTHER_SPECS["svm"]) == (784,)
    assert sample_shape_for(OTHER_SPECS["char-lstm"]) == (80,)
    with pytest.raises(ValueError, match="cannot derive an input shape"):
        sample_shape_for({"name": "resnet"})


def test_onnxruntime_matches_torch(exported: dict[str, Any]) -> None:
    predictor = Predictor(exported["path"])
    x = np.random.default_rng(1).normal(size=(32, *SHAPES[exported["key"]])).astype(np.float32)
    expected = torch_logits(exported["model"], x)
    logits = predictor.logits(x)
    assert logits.dtype == np.float32 and logits.shape == (32, 10)
    assert np.max(np.abs(logits - expected)) <= 1e-5
    proba = predictor.predict_proba(x)
    assert proba.dtype == np.float32
    np.testing.assert_allclose(proba.sum(axis=1), 1.0, atol=1e-5)
    np.testing.assert_allclose(proba, softmax(expected), atol=1e-5)
    np.testing.assert_array_equal(predictor.predict(x), expected.argmax(axis=1))
    # chunked runs give the same answer
    np.testing.assert_array_equal(predictor.predict(x, batch_size=5), expected.argmax(axis=1))


def test_dynamic_batch_axis(exported: dict[str, Any]) -> None:
    predictor = Predictor(exported["path"])
    for n in (1, 3, 64):
        x = np.random.default_rng(n).normal(size=(n, *SHAPES[exported["key"]])).astype(np.float32)
        assert predictor.predict_proba(x).shape == (n, 10)
    assert predictor.predict(np.zeros((0, *SHAPES[exported["key"]]), np.float32)).shape == (0,)


def test_sidecar(exported: dict[str, Any]) -> None:
    path = exported["path"]
    assert exported["returned"] == path
    meta = json.loads(sidecar_path(path).read_text())
    assert sidecar_path(path).name == "model.onnx.json"
    assert meta["model"] == exported["spec"]
    assert tuple(meta["input_shape"]) == SHAPES[exported["key"]]
    assert meta["num_classes"] == 10
    assert meta["round"] == 7
    assert meta["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
    assert meta["opset"] >= 17
    assert (meta["input"], meta["output"]) == ("input", "logits")
    assert sorted(p.name for p in path.parent.iterdir()) == ["model.onnx", "model.onnx.json"]  # no temp files left


def test_graph_names_and_opset(exported: dict[str, Any]) -> None:
    onnx = pytest.importorskip("onnx")
    graph = onnx.load(str(exported["path"]))
    assert [i.name for i in graph.graph.input] == ["input"]
    assert [o.name for o in graph.graph.output] == ["logits"]
    assert max(o.version for o in graph.opset_import if o.domain in ("", "ai.onnx")) >= 17
    batch = graph.graph.input[0].type.tensor_type.shape.dim[0]
    assert batch.dim_param and not batch.dim_value  # symbolic: any batch size


def test_bad_input_shape_names_the_expected_shape(exported: dict[str, Any]) -> None:
    predictor = Predictor(exported["path"])
    want = ", ".join(str(d) for d in SHAPES[exported["key"]])
    with pytest.raises(ValueError, match=rf"expects \(batch, {want}\)"):
        predictor.predict(np.zeros((4, 5, 7), np.float32))
    with pytest.raises(ValueError, match="numeric"):
        predictor.predict(np.array([["a"] * 3]))


def test_single_sample_hint(tmp_path: Path) -> None:
    spec = SPECS["cnn-32x32x3"]
    model, weights = random_model(spec, 0)
    del model
    path = export_onnx(spec, weights, tmp_path / "m.onnx", sample_shape=(3, 32, 32))
    with pytest.raises(ValueError, match=r"x\[None\]"):
        Predictor(path).predict(np.zeros((3, 32, 32), np.float32))


def test_convenience_shapes(tmp_path: Path) -> None:
    """Digits as 8x8 images for the MLP, grey images without the channel axis for the CNN, uint8 pixels."""
    mlp_model, mlp_w = random_model(SPECS["mlp-digits"], 2)
    mlp = Predictor(export_onnx(SPECS["mlp-digits"], mlp_w, tmp_path / "mlp.onnx"))
    x = np.random.default_rng(0).random((6, 8, 8), dtype=np.float32)
    np.testing.assert_array_equal(mlp.predict(x), torch_logits(mlp_model, x.reshape(6, 64)).argmax(1))

    cnn_model, cnn_w = random_model(SPECS["cnn-28x28x1"], 3)
    cnn = Predictor(export_onnx(SPECS["cnn-28x28x1"], cnn_w, tmp_path / "cnn.onnx"))
    pixels = np.random.default_rng(0).integers(0, 256, (5, 28, 28), dtype=np.uint8)
    expected = torch_logits(cnn_model, (pixels[:, None].astype(np.float32) / 255.0)).argmax(1)
    np.testing.assert_array_equal(cnn.predict(pixels), expected)


def test_sidecar_digest_mismatch_and_missing_file(tmp_path: Path) -> None:
    spec = SPECS["mlp-digits"]
    _, weights = random_model(spec, 4)
    path = export_onnx(spec, weights, tmp_path / "a.onnx")
    other = export_onnx(spec, weights * 2, tmp_path / "b.onnx")
    shutil.copy(other, path)  # new model, old sidecar
    with pytest.raises(ValueError, match="does not match its sidecar"):
        Predictor(path)
    Predictor(path, verify=False)
    with pytest.raises(FileNotFoundError):
        Predictor(tmp_path / "missing.onnx")


def test_without_sidecar_shape_comes_from_the_graph(tmp_path: Path) -> None:
    spec = SPECS["cnn-28x28x1"]
    _, weights = random_model(spec, 5)
    path = export_onnx(spec, weights, tmp_path / "m.onnx")
    sidecar_path(path).unlink()
    predictor = Predictor(path)
    assert predictor.input_shape == (1, 28, 28)
    with pytest.raises(ValueError, match=r"expects \(batch, 1, 28, 28\)"):
        predictor.predict(np.zeros((2, 3, 28, 28), np.float32))


def test_latency_and_threads(tmp_path: Path) -> None:
    spec = SPECS["mlp-digits"]
    _, weights = random_model(spec, 6)
    predictor = Predictor(export_onnx(spec, weights, tmp_path / "m.onnx"), intra_op_num_threads=2)
    lat = predictor.latency(np.zeros((64, 64), np.float32), repeats=5)
    assert lat["batch"] == 64 and lat["repeats"] == 5 and lat["threads"] == 2
    assert 0 < lat["min_ms"] <= lat["median_ms"] <= lat["p90_ms"]
    with pytest.raises(ValueError, match="repeats"):
        predictor.latency(np.zeros((1, 64), np.float32), repeats=0)


def test_prediction_never_imports_torch(tmp_path: Path) -> None:
    spec = SPECS["cnn-28x28x1"]
    _, weights = random_model(spec, 7)
    path = export_onnx(spec, weights, tmp_path / "m.onnx", round=1)
    code = textwrap.dedent(
        f"""
        import sys
        import numpy as np
        import edge_client.learning.predictor
        import edge_client.learning.data
        p = edge_client.learning.predictor.Predictor({str(path)!r})
        ids = p.predict(np.zeros((3, 1, 28, 28), np.float32))
        proba = p.predict_proba(np.zeros((1, 1, 28, 28), np.float32))
        p.latency(np.zeros((1, 1, 28, 28), np.float32), repeats=2)
        assert ids.shape == (3,) and proba.shape == (1, 10)
        loaded = sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))
        assert not loaded, loaded
        assert "edge_client.learning.models" not in sys.modules
        print("ok")
        """
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok"


def test_svm_onnx_parity_and_sign_rule(tmp_path: Path) -> None:
    """One score column: logits match torch, predict uses the SVM's own sign rule, probabilities are refused."""
    model, weights = random_model(OTHER_SPECS["svm"], 4)
    predictor = Predictor(export_onnx(OTHER_SPECS["svm"], weights, tmp_path / "svm.onnx"))
    x = np.random.default_rng(2).normal(size=(64, 1, 28, 28)).astype(np.float32)  # images, flattened by the SVM
    expected = torch_logits(model, x)
    logits = predictor.logits(x)
    assert logits.shape == (64, 1) and np.max(np.abs(logits - expected)) <= 1e-5
    labels = predictor.predict(x)
    np.testing.assert_array_equal(labels, predicted_labels(torch.from_numpy(expected)).numpy())
    assert 0 < labels.sum() < 64  # both signs occur, so the rule is really exercised
    with pytest.raises(ValueError, match="single score output"):
        predictor.predict_proba(x)


def test_char_lstm_onnx_parity(tmp_path: Path) -> None:
    """Character indices as float32 (as ArrayDataset stores them) give the same 80 logits in onnxruntime."""
    model, weights = random_model(OTHER_SPECS["char-lstm"], 5)
    predictor = Predictor(export_onnx(OTHER_SPECS["char-lstm"], weights, tmp_path / "lstm.onnx"))
    x = np.random.default_rng(3).integers(0, 80, (9, 80)).astype(np.float32)
    expected = torch_logits(model, x)
    logits = predictor.logits(x)
    assert logits.shape == (9, 80) and np.max(np.abs(logits - expected)) <= 1e-5
    np.testing.assert_array_equal(predictor.predict(x, batch_size=4), expected.argmax(1))
