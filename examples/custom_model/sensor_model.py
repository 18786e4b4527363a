"""A tiny 1-D convolutional network that reads a vibration sensor's window and estimates its dominant frequency.

This module is the "your own model" of the example: edgefl ships nothing like it. The server and every device build
it from the run's ``[model]`` section::

    [model]
    factory = "sensor_model:build"   # package.module:callable, found on --model-path (devices) / PYTHONPATH (server)
    input_shape = [1, 64]            # one sample without the batch axis, for the ONNX export
    filters = 8                      # any other key is passed to build()
"""

from __future__ import annotations

from torch import nn


def build(filters: int = 8, kernel: int = 7) -> nn.Module:
    """Two 1-D convolutions, a global average and a linear read-out: (batch, 1, 64) -> (batch, 1) cycles/window."""
    return nn.Sequential(
        nn.Conv1d(1, filters, kernel, padding=kernel // 2),
        nn.ReLU(),
        nn.Conv1d(filters, filters, kernel, padding=kernel // 2),
        nn.ReLU(),
        nn.AdaptiveAvgPool1d(1),
        nn.Flatten(),
        nn.Linear(filters, 1),
    )
