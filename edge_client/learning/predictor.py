"""Inference with onnxruntime, and the ONNX export it reads.

:class:`Predictor` runs an exported model with onnxruntime only: importing this module and predicting never imports
torch (RESEARCH.md section 3: torch costs ~207 MiB RSS and seconds of import on a device, onnxruntime ~33 MiB).
:func:`export_onnx` needs torch and imports it lazily; it lives here rather than in ``server`` because a device may
export its own model (``edge-client benchmark``) and ``edge_client`` never imports ``server``.

An export is two files: ``model.onnx`` (input ``"input"``, output ``"logits"``, dynamic batch axis) and the sidecar
``model.onnx.json``::

    {"format": 1, "model": {<model spec>}, "input_shape": [C, H, W] or [F], "num_classes": 10, "round": 7,
     "sha256": "<hex digest of model.onnx>", "opset": 17, "exporter": "torchscript"}
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import math
import os
import time
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from edge_client.learning.factories import FACTORY_KEY

__all__ = [
    "INPUT_NAME",
    "OPSET",
    "OUTPUT_NAME",
    "Predictor",
    "export_onnx",
    "read_sidecar",
    "sample_shape_for",
    "sha256_file",
    "sidecar_path",
    "softmax",
]

INPUT_NAME = "input"
OUTPUT_NAME = "logits"
OPSET = 17  # onnxruntime >= 1.21.1 (the Raspberry Pi floor, RESEARCH.md section 3) runs opset 17
SIDECAR_FORMAT = 1
_FLAT_MODELS = ("mlp", "svm")  # models that flatten their input themselves


# ---------------------------------------------------------------------------------------------------- export
def sample_shape_for(spec: Mapping[str, Any]) -> tuple[int, ...]:
    """The input shape of one sample (no batch axis) of a model spec: cnn / fedveca-cnn (C, H, W), mlp / svm (F,),
    char-lstm (seq_len,), a user's model (``factory``) its ``input_shape`` key."""
    name = spec.get("name") if isinstance(spec, Mapping) else None
    if isinstance(spec, Mapping) and FACTORY_KEY in spec:
        shape = spec.get("input_shape")
        if not (isinstance(shape, list) and shape and all(isinstance(d, int) and d > 0 for d in shape)):
            raise ValueError(
                f"model.input_shape = {shape!r}: a factory model needs one sample's input shape without the batch "
                "axis for the ONNX export, e.g. input_shape = [1, 64]"
            )
        return tuple(shape)
    if name in ("cnn", "fedveca-cnn"):
        return (int(spec.get("in_channels", 1)), int(spec.get("image_size", 28)), int(spec.get("image_size", 28)))
    if name in _FLAT_MODELS:
        if "in_features" not in spec:
            raise ValueError(f"model {name!r}: missing key 'in_features', needed for the input shape")
        return (int(spec["in_features"]),)
    if name == "char-lstm":
        return (int(spec.get("seq_len", 80)),)
    raise ValueError(f"cannot derive an input shape for model {name!r}; pass sample_shape explicitly")


def sidecar_path(path: str | Path) -> Path:
    """``model.onnx`` -> ``model.onnx.json``."""
    path = Path(path)
    return path.with_name(path.name + ".json")


def sha256_file(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def read_sidecar(path: str | Path) -> dict[str, Any] | None:
    """The sidecar of an ONNX file, or None when there is none."""
    side = sidecar_path(path)
    if not side.exists():
        return None
    try:
        meta = json.loads(side.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{side}: unreadable sidecar: {exc}") from None
    if not isinstance(meta, dict):
        raise ValueError(f"{side}: sidecar must be a JSON object")
    return meta


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()


def _torch_export(model: Any, dummy: Any, target: Path) -> str:
    """Export ``model`` to ``target`` with a dynamic batch axis; returns the exporter used.

    torch 2.13 defaults to the torch.export-based ("dynamo") exporter, which needs ``onnxscript``; the
    TorchScript-based exporter (``dynamo=False``) needs only the ``onnx`` package, is still supported (deprecated)
    and is exact for these models, so it goes first. The dynamo exporter is the fallback for a torch that removed it.
    """
    import torch

    if importlib.util.find_spec("onnx") is None:
        raise RuntimeError("ONNX export needs the 'onnx' package (the server side installs it): pip install onnx")
    common = {"input_names": [INPUT_NAME], "output_names": [OUTPUT_NAME], "opset_version": OPSET}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            torch.onnx.export(
                model,
                (dummy,),
                str(target),
                dynamo=False,
                dynamic_axes={INPUT_NAME: {0: "batch"}, OUTPUT_NAME: {0: "batch"}},
                **common,
            )
        return "torchscript"
    except (TypeError, NotImplementedError, RuntimeError) as legacy_exc:
        try:
            import onnxscript  # noqa: F401
        except ImportError:
            raise RuntimeError(
                f"ONNX export failed with the TorchScript exporter ({legacy_exc}); the torch.export-based exporter "
                "needs onnxscript: pip install onnxscript"
            ) from legacy_exc
        batch = torch.export.Dim("batch", min=1)
        program = torch.onnx.export(
            model, (dummy,), dynamo=True, dynamic_shapes=({0: batch},), external_data=False, **common
        )
        program.save(str(target))
        return "dynamo"


def export_onnx(
    model_spec: Mapping[str, Any],
    weights: np.ndarray,
    path: str | Path,
    *,
    sample_shape: tuple[int, ...] | None = None,
    round: int | None = None,
    model_factory: Any = None,
    task: str = "classification",
) -> Path:
    """Build the model of ``model_spec``, load the flat ``weights``, write ``path`` and its JSON sidecar.

    Both files are written atomically (temporary file + ``os.replace``), the ONNX file first, so a reader that finds
    the sidecar finds the ONNX file it describes. ``model_factory`` (default ``build_model``) is for applications
    that bring their own model; ``task`` (a task name, in the sidecar) tells ``Predictor.predict`` what the outputs
    are. Returns ``path``.
    """
    import torch

    from edge_client.learning.models import build_model, set_flat

    path = Path(path)
    spec = dict(model_spec)
    shape = tuple(int(d) for d in (sample_shape if sample_shape is not None else sample_shape_for(spec)))
    if not shape or any(d <= 0 for d in shape):
        raise ValueError(f"sample_shape must be positive dimensions without the batch axis, got {shape}")
    model = (model_factory or build_model)(spec)
    set_flat(model, np.asarray(weights, dtype=np.float32))
    model.eval()
    dummy = torch.zeros((2, *shape), dtype=torch.float32)  # batch 2: a batch of 1 may get specialised away
    with torch.no_grad():
        logits = model(dummy)
    if logits.ndim != 2:
        raise ValueError(f"the model maps {(2, *shape)} to {tuple(logits.shape)}; expected (batch, classes) logits")
    num_classes = int(logits.shape[1])

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.export.tmp")
    try:
        exporter = _torch_export(model, dummy, tmp)
        data = tmp.read_bytes()
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
    _write_atomic(path, data)
    meta = {
        "format": SIDECAR_FORMAT,
        "model": spec,
        "input_shape": list(shape),
        "num_classes": num_classes,
        "round": None if round is None else int(round),
        "sha256": hashlib.sha256(data).hexdigest(),
        "opset": OPSET,
        "exporter": exporter,
        "input": INPUT_NAME,
        "output": OUTPUT_NAME,
        "task": task,
    }
    _write_atomic(sidecar_path(path), (json.dumps(meta, indent=2, sort_keys=True) + "\n").encode())
    return path


# ---------------------------------------------------------------------------------------------------- inference
def softmax(logits: np.ndarray) -> np.ndarray:
    """Row-wise softmax in float32, stable for large logits."""
    z = np.asarray(logits, dtype=np.float32)
    z = z - z.max(axis=-1, keepdims=True)
    np.exp(z, out=z)
    z /= z.sum(axis=-1, keepdims=True)
    return z


class Predictor:
    """An exported model served by onnxruntime on the CPU.

    ``intra_op_num_threads`` fixes onnxruntime's thread pool (1 keeps latencies comparable and leaves the other cores
    to training); 0 lets onnxruntime choose. With ``verify`` the ONNX file must match the sidecar's sha256.
    """

    def __init__(
        self,
        path: str | Path,
        *,
        intra_op_num_threads: int = 1,
        inter_op_num_threads: int = 1,
        verify: bool = True,
    ) -> None:
        import onnxruntime as ort

        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"ONNX model {self.path} does not exist")
        self.meta = read_sidecar(self.path) or {}
        if verify and self.meta.get("sha256"):
            actual = sha256_file(self.path)
            if actual != self.meta["sha256"]:
                raise ValueError(
                    f"{self.path}: sha256 {actual[:12]}... does not match its sidecar ({self.meta['sha256'][:12]}...);"
                    " the model and the sidecar come from different exports"
                )
        if intra_op_num_threads < 0 or inter_op_num_threads < 0:
            raise ValueError("thread counts must be >= 0 (0: onnxruntime's default)")
        options = ort.SessionOptions()
        options.intra_op_num_threads = int(intra_op_num_threads)
        options.inter_op_num_threads = int(inter_op_num_threads)
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        try:
            self.session = ort.InferenceSession(str(self.path), options, providers=["CPUExecutionProvider"])
        except Exception as exc:  # onnxruntime raises its own exception types for bad files
            raise ValueError(f"{self.path}: onnxruntime cannot load the model: {exc}") from None
        self.intra_op_num_threads = int(intra_op_num_threads)
        inp = self.session.get_inputs()[0]
        self.input_name = inp.name
        self.output_name = self.session.get_outputs()[0].name
        if "input_shape" in self.meta:
            self.input_shape = tuple(int(d) for d in self.meta["input_shape"])
        else:  # no sidecar: the fixed dimensions the graph declares
            self.input_shape = tuple(d if isinstance(d, int) else -1 for d in inp.shape[1:])
        self.num_classes: int | None = self.meta.get("num_classes")
        self.task: str = self.meta.get("task", "classification")

    def __repr__(self) -> str:
        return f"Predictor({str(self.path)!r}, input_shape={self.input_shape}, threads={self.intra_op_num_threads})"

    def _check(self, x: np.ndarray) -> np.ndarray:
        x = np.asarray(x)
        if not (np.issubdtype(x.dtype, np.floating) or np.issubdtype(x.dtype, np.integer)):
            raise ValueError(f"input must be numeric, got dtype {x.dtype}")
        want = self.input_shape
        expected = f"(batch, {', '.join(str(d) for d in want)})"
        if x.ndim == len(want) + 1 and all(w in (-1, d) for w, d in zip(want, x.shape[1:], strict=True)):
            pass
        elif (
            x.ndim >= 2
            and len(want) == 1
            and want[0] > 0
            and math.prod(x.shape[1:]) == want[0]
            and self.meta.get("model", {}).get("name") in _FLAT_MODELS
        ):
            x = x.reshape(len(x), want[0])  # the MLP / SVM flatten their input themselves, e.g. digits (N, 8, 8)
        elif len(want) == 3 and want[0] == 1 and x.ndim == 3 and x.shape[1:] == want[1:]:
            x = x[:, None]  # (N, H, W) grey images, as data.prepare_images accepts them
        elif x.shape == tuple(want):
            raise ValueError(
                f"input has shape {x.shape}, the shape of ONE sample; the model expects a batch {expected}: "
                "pass x[None] for a single sample"
            )
        else:
            raise ValueError(f"input has shape {x.shape}; the model {self.path.name} expects {expected}")
        if x.dtype == np.uint8 and len(want) == 3:
            x = x.astype(np.float32) / np.float32(255.0)  # images as stored on a device, like data.prepare_images
        x = np.ascontiguousarray(x, dtype=np.float32)
        if not np.isfinite(x).all():
            raise ValueError("input contains NaN or infinite values")
        return x

    def logits(self, x: np.ndarray, batch_size: int | None = None) -> np.ndarray:
        """Raw model outputs, (N, classes) float32; ``batch_size`` bounds the memory of one run."""
        x = self._check(x)
        if len(x) == 0:
            return np.zeros((0, self.num_classes or 0), dtype=np.float32)
        step = len(x) if not batch_size or batch_size <= 0 else int(batch_size)
        parts = [
            self.session.run([self.output_name], {self.input_name: x[i : i + step]})[0] for i in range(0, len(x), step)
        ]
        return np.asarray(parts[0] if len(parts) == 1 else np.concatenate(parts), dtype=np.float32)

    def predict_proba(self, x: np.ndarray, batch_size: int | None = None) -> np.ndarray:
        """Class probabilities (softmax of the logits), (N, classes) float32; a binary task's P(label 1), (N,)."""
        if self.task == "regression":
            raise ValueError(f"{self.path.name} is a regression model: it predicts values, not probabilities")
        logits = self.logits(x, batch_size)
        if self.task == "binary":
            return (1.0 / (1.0 + np.exp(-logits.reshape(len(logits), -1)[:, 0]))).astype(np.float32)
        if logits.shape[1] == 1:
            raise ValueError(
                f"{self.path.name} has a single score output (e.g. the SVM), not class probabilities; use predict"
            )
        return softmax(logits)

    def predict(self, x: np.ndarray, batch_size: int | None = None) -> np.ndarray:
        """Class ids, (N,) int64: argmax, or for a single-output model (the SVM) the sign rule of
        ``edge_client.learning.tasks.predicted_labels`` (1 where the score is negative, else 0); a binary task's label
        (1 where the logit is positive); a regression task's values ((N,) for one output, else (N, outputs) float32)."""
        logits = self.logits(x, batch_size)
        if self.task == "regression":
            return logits[:, 0] if logits.shape[1] == 1 else logits
        if self.task == "binary":
            return (logits.reshape(len(logits), -1)[:, 0] > 0).astype(np.int64)
        if logits.shape[1] == 1:
            return (logits[:, 0] < 0).astype(np.int64)
        return logits.argmax(axis=1).astype(np.int64)

    def latency(self, x: np.ndarray, repeats: int = 50, warmup: int = 3) -> dict[str, Any]:
        """Milliseconds per ``session.run`` on the whole batch ``x`` (input checks not included)."""
        if repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {repeats}")
        x = self._check(x)
        feed = {self.input_name: x}
        for _ in range(max(0, warmup)):
            self.session.run([self.output_name], feed)
        times = np.empty(repeats)
        for i in range(repeats):
            t0 = time.perf_counter()
            self.session.run([self.output_name], feed)
            times[i] = time.perf_counter() - t0
        ms = times * 1000.0
        return {
            "batch": len(x),
            "repeats": repeats,
            "threads": self.intra_op_num_threads,
            "median_ms": float(np.median(ms)),
            "p90_ms": float(np.percentile(ms, 90)),
            "mean_ms": float(ms.mean()),
            "min_ms": float(ms.min()),
        }
