"""Checkpoint and resume: after every round the model, the run's identity and the strategy's state go to
``checkpoint.npz``; a server restarted on the same output directory and configuration resumes after the last
completed round (a different configuration is refused, naming the key that differs).

Strategy state is stored as npz arrays for vectors (a d-float list in JSON is ~20 bytes a value and slow to parse)
and one JSON string for the rest and the selection RNG, which round-trips Python floats exactly.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from server.config import ConfigError, RunConfig
from server.strategies import Strategy

#: Config keys that may change between a run and its resumption: where the broker is, how to log in, and how long to
#: wait for devices to register (none of them changes what the run computes).
RESUMABLE_CHANGES = ("broker.", "run.out", "clients.register_timeout_s")
STATE_PREFIX = "strategy."
log = logging.getLogger("edgefl.server")


def config_identity(config: RunConfig) -> dict[str, Any]:
    """The configuration as flat ``section.key`` values, minus what may change on a restart."""
    sections = {**dataclasses.asdict(config), "algorithm": {}}  # only the chosen algorithm's parameters matter
    sections[f"algorithm.{config.train.algorithm}"] = config.algorithm_params()
    flat = {f"{section}.{key}": value for section, values in sections.items() for key, value in values.items()}
    return {k: v for k, v in flat.items() if not k.startswith(RESUMABLE_CHANGES)}


def resumes(out_dir: Path) -> bool:
    """Whether a server started on ``out_dir`` continues an unfinished run (rather than starting afresh)."""
    path = Path(out_dir) / "checkpoint.npz"
    if not path.exists():
        return False
    with np.load(path) as saved:
        return "finished" in saved.files and not bool(saved["finished"])  # no marker: written before resumption


def pack_state(strategy: Strategy) -> dict[str, np.ndarray]:
    """``strategy``'s state as npz entries: each array as itself, the rest and the selection RNG as one JSON string."""
    state = strategy.state_dict()
    arrays = {STATE_PREFIX + k: v for k, v in state.items() if isinstance(v, np.ndarray)}
    rest = {k: v for k, v in state.items() if not isinstance(v, np.ndarray)}
    meta = {"state": rest, "arrays": sorted(k for k, v in state.items() if isinstance(v, np.ndarray)),
            "rng": strategy.rng.bit_generator.state}  # fmt: skip
    return {**arrays, "strategy": np.array(json.dumps(meta))}


def unpack_state(strategy: Strategy, saved: Any) -> None:
    """Restore what ``pack_state`` wrote into ``saved`` (an open npz file or a dict of arrays) after ``setup``."""
    meta = json.loads(str(saved["strategy"]))
    state = {**meta["state"], **{k: np.array(saved[STATE_PREFIX + k]) for k in meta["arrays"]}}
    strategy.load_state_dict(state)
    strategy.rng.bit_generator.state = meta["rng"]


@dataclass
class Resumed:
    """Where an unfinished run stopped (round 0: where a fresh run starts)."""

    weights: np.ndarray
    round: int
    model_version: int
    run_id: str


class Checkpoint:
    """The run directory's ``checkpoint.npz``, replaced atomically so a crash never leaves half a file."""

    def __init__(self, out_dir: Path, config: RunConfig, model_spec: dict[str, Any]) -> None:
        self.path = Path(out_dir) / "checkpoint.npz"
        self.config = config
        self.model_spec = model_spec

    def _write(self, entries: dict[str, Any]) -> None:
        tmp = self.path.with_name("checkpoint.tmp.npz")
        np.savez(tmp, **entries)
        os.replace(tmp, self.path)

    def save(self, weights: np.ndarray, round_: int, version: int, state: dict[str, np.ndarray], run_id: str) -> None:
        """The last completed round's model and algorithm state (``pack_state`` of the strategy after that round)."""
        self._write({
            "weights": weights, "round": round_, "model_version": version, "run_id": run_id,
            "model_spec": json.dumps(self.model_spec), "config": json.dumps(config_identity(self.config)),
            "finished": False, **state,
        })  # fmt: skip

    def mark_finished(self) -> None:
        """Flag the checkpoint so that the next run in this directory starts afresh instead of resuming."""
        if not self.path.exists():
            return
        with np.load(self.path) as saved:
            entries = {k: saved[k] for k in saved.files}
        self._write({**entries, "finished": True})

    def start(self, strategy: Strategy, weights: np.ndarray) -> Resumed:
        """Where the run starts: the unfinished run in ``out_dir``, its strategy state restored (after
        ``strategy.setup``, whose initial state it overwrites), or afresh from ``weights`` with a new run id."""
        resumed = self.load(strategy, weights.size)
        if resumed is None:
            return Resumed(weights, 0, 0, uuid.uuid4().hex[:12])
        log.warning("resuming run %s from round %d (checkpoint %s, model version %d): rounds %d-%d to go",
                    resumed.run_id, resumed.round, self.path, resumed.model_version, resumed.round + 1,
                    self.config.run.rounds)  # fmt: skip
        return resumed

    def load(self, strategy: Strategy, num_params: int) -> Resumed | None:
        """The unfinished run to continue, its strategy state restored (after ``strategy.setup``), or None."""
        if not resumes(self.path.parent):
            return None
        with np.load(self.path) as saved:
            self._check_resumable(saved, num_params)
            unpack_state(strategy, saved)
            run_id = str(saved["run_id"]) if "run_id" in saved.files else ""
            return Resumed(saved["weights"].astype(np.float32), int(saved["round"]), int(saved["model_version"]),
                           run_id)  # fmt: skip

    def _check_resumable(self, saved: Any, num_params: int) -> None:
        """Refuse to continue a run made with another configuration or model: say which key differs and what to do."""
        path = self.path
        fix = f"rerun with the original configuration, or choose another run.out (--out) / delete {path} to start anew"
        before = json.loads(str(saved["config"]))
        now = config_identity(self.config)
        for key in sorted(set(before) | set(now)):
            if before.get(key) != now.get(key):
                raise ConfigError(
                    f"{path} is an unfinished run with {key} = {before.get(key)!r}; this configuration has "
                    f"{now.get(key)!r}: {fix}"
                )
        if json.loads(str(saved["model_spec"])) != self.model_spec:
            raise ConfigError(f"{path} holds the model {saved['model_spec']!s}, not {self.model_spec}: {fix}")
        if saved["weights"].size != num_params:
            raise ConfigError(f"{path} holds {saved['weights'].size} parameters, this model {num_params}: {fix}")
