"""Export the global model to ONNX for inference on devices (``edge_client.learning.predictor.Predictor``).

The implementation lives in :mod:`edge_client.learning.predictor` (torch imported lazily there), because a device
exports its own model for ``edge-client benchmark`` and ``edge_client`` never imports ``server``. This module is the
server's entry point, used after each round::

    export_onnx(spec, weights, out / "model.onnx", sample_shape=sample_shape_for(spec), round=t)

It writes ``model.onnx`` (input ``"input"``, output ``"logits"``, dynamic batch axis, opset 17, TorchScript-based
exporter: the torch.export-based one needs onnxscript) and ``model.onnx.json`` (model spec, input shape without the
batch axis, number of classes, round, sha256 of the ONNX file), each atomically.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from edge_client.learning.predictor import OPSET, read_sidecar, sample_shape_for, sidecar_path
from edge_client.learning.predictor import export_onnx as _export_onnx

__all__ = ["OPSET", "BackgroundExporter", "export_onnx", "read_sidecar", "sample_shape_for", "sidecar_path"]

log = logging.getLogger("edgefl.server")


class BackgroundExporter:
    """Exports on a worker thread, so a round's wall clock does not pay for it; the newest request wins.

    ``on_done(path, round)`` runs on the worker after each export (the orchestrator publishes the file).
    """

    def __init__(
        self,
        model_spec: Mapping[str, Any],
        path: Path,
        on_done: Callable[[Path, int], None] | None = None,
        task: str = "classification",
    ) -> None:
        self.model_spec, self.path, self.on_done, self.task = dict(model_spec), path, on_done, task
        self._pending: tuple[np.ndarray, int] | None = None
        self._closed = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._work, name="onnx-export", daemon=True)
        self._thread.start()

    def submit(self, weights: np.ndarray, round_: int) -> None:
        with self._cond:
            self._pending = (weights.copy(), round_)
            self._cond.notify_all()

    def _work(self) -> None:
        while True:
            with self._cond:
                while self._pending is None and not self._closed:
                    self._cond.wait()
                if self._pending is None:
                    return
                (weights, round_), self._pending = self._pending, None
            try:
                export_onnx(self.model_spec, weights, self.path, round=round_, task=self.task)
                if self.on_done:
                    self.on_done(self.path, round_)
            except Exception:  # an export failure must never stop training
                log.exception("ONNX export of round %d failed", round_)
            with self._cond:
                self._cond.notify_all()

    def close(self, timeout: float = 60.0) -> None:
        """Finish what was submitted, then stop the worker."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout)


def export_onnx(
    model_spec: Mapping[str, Any],
    weights: np.ndarray,
    path: Path,
    *,
    sample_shape: tuple[int, ...] | None = None,
    round: int | None = None,
    task: str = "classification",
) -> Path:
    """Build ``model_spec``, load the flat ``weights``, write ``path`` and ``<path>.json``; returns ``path``.

    ``sample_shape`` is one sample's input shape without the batch axis (default: :func:`sample_shape_for`); ``task``
    the run's task name, for ``Predictor.predict``.
    """
    return _export_onnx(model_spec, weights, path, sample_shape=sample_shape, round=round, task=task)
