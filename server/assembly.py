"""Assembling a run from its configuration: the strategy, the data the server keeps, and the orchestrator.

``edge-server run`` and every simulated fleet (``simulate``, ``bench``) build their server here, so a configuration
means the same thing whichever command runs it.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from edge_client.learning.data import ArrayDataset
from edge_client.learning.factories import FACTORY_KEY
from edge_client.learning.models import INPUT_SHAPE_KEY
from edge_client.learning.tasks import build_task
from edge_client.wire.transport import Link, LinkConfig
from server.config import ConfigError, RunConfig
from server.datasets import NO_DATA, DatasetBundle, load_dataset, split_root
from server.deadlines import DeviceTimes
from server.evaluation import Evaluator
from server.orchestrator import Orchestrator, RoundObserver
from server.strategies import build_strategy
from server.target import Target, eval_mode, run_target


def model_spec(config: RunConfig, bundle: DatasetBundle | None) -> dict[str, Any]:
    """The configured model, or the data set's default; either way with the data set's input standardisation, and a
    factory model's ``input_shape`` (for the ONNX export) one sample of the data set's unless configured."""
    if bundle is None:
        if not config.model:
            raise ConfigError(
                f'data.dataset = "{NO_DATA}": the server has no data set to take a model from; configure [model] '
                'name = ... or factory = "package.module:callable"'
            )
        return dict(config.model)
    if not config.model:
        return bundle.model
    shape = {INPUT_SHAPE_KEY: list(bundle.train.x.shape[1:])} if FACTORY_KEY in config.model else {}
    return {**bundle.input_stats, **shape, **config.model}


def dataset_of(config: RunConfig) -> DatasetBundle:
    """The configured data set (``[data] dataset``, and ``label_column`` for a CSV file), split by the run's seed."""
    return load_dataset(config.data.dataset, seed=config.run.seed, label_column=config.data.label_column)


def dataset_name(bundle: DatasetBundle | None) -> str:
    """The data set as summaries and the dashboard name it: the bundle's name, or "none" for a server without."""
    return bundle.name if bundle else NO_DATA


def server_data(config: RunConfig) -> tuple[DatasetBundle | None, ArrayDataset | None]:
    """The data set the server holds (None with ``data.dataset = "none"``) and the root data set of the algorithm."""
    if config.data.dataset == NO_DATA:
        return split_clients(config, None)
    return split_clients(config, dataset_of(config))


def run_target_of(config: RunConfig, bundle: DatasetBundle | None) -> Target:
    """The run's target as the orchestrator of ``make_orchestrator(config, bundle)`` judges it."""
    return run_target(config, build_task(config.task), eval_mode(config, bundle is not None))


def split_clients(config: RunConfig, bundle: DatasetBundle | None) -> tuple[DatasetBundle | None, ArrayDataset | None]:
    """The bundle whose training set the clients share, and the root data set the algorithm needs (held by none)."""
    strategy = build_strategy(config)
    if bundle is None:
        if strategy.root_size(1):
            raise ConfigError(
                f'train.algorithm = "{strategy.name}" needs a root data set on the server, and data.dataset = '
                f'"{NO_DATA}"; name a data set or choose another algorithm'
            )
        return None, None
    size = strategy.root_size(len(bundle.train))
    if not size:
        return bundle, None
    root, train = split_root(bundle.train, size, config.run.seed)
    return dataclasses.replace(bundle, train=train), root


def make_orchestrator(
    config: RunConfig,
    bundle: DatasetBundle | None,
    out_dir: Path,
    *,
    link_config: LinkConfig | None = None,
    link: Link | None = None,
    root: ArrayDataset | None = None,
    observer: RoundObserver | None = None,
    extra: dict[str, Any] | None = None,
    times: DeviceTimes | None = None,
) -> Orchestrator:
    """The server for ``bundle``: the configured model, evaluated on the data set's test split (or, without a data
    set, by the devices)."""
    spec = model_spec(config, bundle)
    summary_extra = {"dataset": dataset_name(bundle), "partition": config.data.partition,
                     "seed": config.run.seed}  # fmt: skip
    from server.buffered.loop import BufferedOrchestrator

    loop = BufferedOrchestrator if config.train.mode == "buffered" else Orchestrator
    return loop(
        config,
        link_config,  # type: ignore[arg-type]  # unused when ``link`` is given
        Evaluator(spec, bundle.test, build_task(config.task)) if bundle else None,
        spec,
        out_dir,
        observer=observer,
        summary_extra={**summary_extra, **(extra or {})},
        root=root,
        link=link,
        times=times,
    )
