"""Assembling a run from its configuration: the strategy, the data the server keeps, and the orchestrator.

``edge-server run`` and every simulated fleet (``simulate``, ``bench``) build their server here, so a configuration
means the same thing whichever command runs it.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from edge_client.data import ArrayDataset
from edge_client.transport import Link, LinkConfig
from server.config import RunConfig
from server.deadlines import DeviceTimes
from server.evaluation import Evaluator
from server.experiments.datasets import DatasetBundle, split_root
from server.orchestrator import Orchestrator, RoundObserver, train_settings
from server.strategies import Strategy, make_strategy


def build_strategy(config: RunConfig) -> Strategy:
    """The configured strategy; building it checks what the contract alone cannot (e.g. FedVeca's tau bounds)."""
    t = config.train
    return make_strategy(t.algorithm, train_settings(config), config.algorithm_params(), config.run.seed,
                         rounds=config.run.rounds)  # fmt: skip


def model_spec(config: RunConfig, bundle: DatasetBundle) -> dict[str, Any]:
    """The configured model, or the data set's default; either way with the data set's input standardisation."""
    return {**bundle.input_stats, **config.model} if config.model else bundle.model


def split_clients(config: RunConfig, bundle: DatasetBundle) -> tuple[DatasetBundle, ArrayDataset | None]:
    """The bundle whose training set the clients share, and the root data set the algorithm needs (held by none)."""
    size = build_strategy(config).root_size(len(bundle.train))
    if not size:
        return bundle, None
    root, train = split_root(bundle.train, size, config.run.seed)
    return dataclasses.replace(bundle, train=train), root


def make_orchestrator(
    config: RunConfig,
    bundle: DatasetBundle,
    out_dir: Path,
    *,
    link_config: LinkConfig | None = None,
    link: Link | None = None,
    root: ArrayDataset | None = None,
    observer: RoundObserver | None = None,
    extra: dict[str, Any] | None = None,
    times: DeviceTimes | None = None,
) -> Orchestrator:
    """The server for ``bundle``: the configured model, evaluated on the data set's test split."""
    spec = model_spec(config, bundle)
    summary_extra = {"dataset": bundle.name, "partition": config.data.partition, "seed": config.run.seed}
    return Orchestrator(
        config,
        link_config,  # type: ignore[arg-type]  # unused when ``link`` is given
        Evaluator(spec, bundle.test),
        spec,
        out_dir,
        observer=observer,
        summary_extra={**summary_extra, **(extra or {})},
        root=root,
        link=link,
        times=times,
    )
