"""What a user brings: their own data file (a CSV) and their own code (a module with a model and a task factory)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

USER_MODULE = """
import torch
from torch import nn
from edge_client.learning.tasks import Task


def build(width: int = 4) -> nn.Module:
    return nn.Sequential(nn.Linear(3, width), nn.ReLU(), nn.Linear(width, 1))


def huber_task(delta: float = 1.0) -> Task:
    def loss(outputs, targets):
        return nn.functional.huber_loss(outputs, targets.float().reshape(outputs.shape), delta=delta)

    def metrics(outputs, targets):
        return {"mae": float((outputs.reshape(-1) - targets.float()).abs().mean())}

    return Task("huber", loss, metrics, "mae", {"mae": False})
"""


def write_user_code(tmp_path: Path) -> Path:
    """A directory holding a module of its own name (``module_of``) with ``build`` (a model) and ``huber_task``."""
    directory = tmp_path / "mine"
    directory.mkdir()
    (directory / f"user_{tmp_path.name[-8:].replace('-', '_')}.py").write_text(USER_MODULE)
    return directory


def module_of(directory: Path) -> str:
    return next(directory.glob("user_*.py")).stem


def write_csv(path: Path, rows: int = 300, seed: int = 0) -> None:
    """Two classes told apart by a feature in thousands beside one in thousandths: raw, SGD at lr 0.1 cannot."""
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 2, rows)
    big = 5000.0 + 1000.0 * (2 * y - 1) + 300.0 * rng.normal(size=rows)
    small = 0.001 * rng.normal(size=rows)
    lines = ["income,ratio,label", *(f"{b:.3f},{s:.6f},{c}" for b, s, c in zip(big, small, y, strict=True))]
    path.write_text("\n".join(lines) + "\n")
