"""A hand-built orchestrator's configuration and starting model, shared by its unit tests (messages handed to its
dispatch) and its runs over a real mosquitto (tests/integration/test_orchestrator.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from edge_client.learning.models import build_model, get_flat
from server.config import RunConfig, from_dict

SEED = 3


def small_run_config(tmp_path: Path, job: str, *, rounds: int = 3, count: int = 3, **extra: Any) -> RunConfig:
    """digits, ``count`` devices, two local steps a round; the run directory is ``tmp_path/run``."""
    return from_dict(
        {
            "run": {"rounds": rounds, "out": str(tmp_path / "run"), "job": job, "seed": SEED},
            "clients": {"count": count, "register_timeout_s": 60.0, "round_deadline_s": 60.0},
            "data": {"dataset": "digits"},
            "train": {"local_steps": 2, "batch_size": 8, "lr": 0.1},
            **extra,
        }
    )


def initial_weights(model_spec: dict[str, Any]) -> np.ndarray:
    """What the orchestrator starts from: the model built right after torch.manual_seed(run.seed)."""
    torch.manual_seed(SEED)
    return get_flat(build_model(model_spec))
