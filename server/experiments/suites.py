"""Benchmark suites: a base run configuration and the grid of algorithms x partitions x seeds (x variants) to run on it.

A suite is a TOML file: the sections of a run configuration (``[run]``, ``[clients]``, ``[data]``, ``[train]``,
``[model]``, ``[algorithm.NAME]``) plus a ``[bench]`` section::

    [bench]
    description = "TACO Table V, FMNIST column"
    paper = "TACO: FedAvg 71.36, ..."        # what the paper reports, shown beside the results
    scaled = "100 rounds -> 30"              # what was scaled down from the paper to fit the machine
    algorithms = ["fedavg", "taco"]
    partitions = ["taco-groups"]
    seeds = [0, 1, 2]
    mode = "inprocess"                       # or "broker"

    [[bench.variants]]                       # optional: named overrides, one table column each
    name = "C=0.1"
    clients = { fraction = 0.1 }
    algorithms = ["fedumf"]                  # optional: only these of the suite's algorithms run in this variant

    [bench.overrides.fednova]                # optional: sections one algorithm's runs override
    train = { steps_policy = "deadline", round_budget_s = 1.6 }

``match_steps = "fedveca"`` (optional) runs that algorithm first in each cell and gives the others its total local
steps (FedVeca's matched comparison, ``server/experiments/matched_steps.py``).

The suites shipped with edgefl live beside this module in ``suites/``; ``--config FILE`` runs any other.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import tomllib

from server.config import ConfigError, RunConfig, from_dict

MODES = ("inprocess", "broker")


@dataclass
class Variant:
    name: str
    overrides: dict[str, Any] = field(default_factory=dict)
    algorithms: list[str] | None = None  # None: all of the suite's


@dataclass
class RunSpec:
    """One cell of the grid: what to run and where its outputs go (relative to the bench's output directory)."""

    variant: str
    partition: str
    algorithm: str
    seed: int
    config: RunConfig

    @property
    def column(self) -> str:
        """The table column this run belongs to: one per variant and partition."""
        return self.partition if self.variant == "default" else f"{self.variant} · {self.partition}"

    @property
    def path(self) -> str:
        safe = "".join(c if c.isalnum() or c in "-_.=" else "_" for c in self.variant)
        part = "".join(c if c.isalnum() or c in "-_." else "_" for c in self.partition)
        return f"{safe}/{part}/{self.algorithm}/seed-{self.seed}"


@dataclass
class Suite:
    name: str
    base: dict[str, Any]
    algorithms: list[str]
    partitions: list[str]
    seeds: list[int]
    variants: list[Variant]
    overrides: dict[str, dict[str, Any]] = field(default_factory=dict)  # algorithm -> sections its runs override
    mode: str = "inprocess"
    match_steps: str = ""  # the algorithm whose measured total local steps the others of its cell are given
    description: str = ""
    paper: str = ""
    scaled: str = ""

    def use_fleet(self, devices: str) -> None:
        """Run every cell on this fleet (``bench --fleet``); the client count follows it."""
        self.base = _merge(self.base, {"fleet": {"devices": devices}})
        self.base.get("clients", {}).pop("count", None)
        for variant in self.variants:
            variant.overrides.get("clients", {}).pop("count", None)

    def runs(self) -> list[RunSpec]:
        """Every run, each validated; all algorithms of a column share the partition and seeds."""
        out = []
        for variant in self.variants:
            for partition in self.partitions:
                for seed in self.seeds:
                    for algorithm in self.algorithms:
                        if variant.algorithms is not None and algorithm not in variant.algorithms:
                            continue
                        data = _merge(self.base, variant.overrides)
                        data = _merge(data, self.overrides.get(algorithm, {}))
                        data = _merge(
                            data,
                            {
                                "run": {"seed": seed, "job": f"bench-{self.name}"},
                                "data": {"partition": partition},
                                "train": {"algorithm": algorithm},
                            },
                        )
                        out.append(RunSpec(variant.name, partition, algorithm, seed, from_dict(data)))
        return out


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def shipped() -> list[str]:
    """Names of the suites that ship with edgefl."""
    return sorted(
        p.name[:-5]
        for p in resources.files("server.experiments").joinpath("suites").iterdir()
        if p.name.endswith(".toml")
    )


def _str_list(bench: dict[str, Any], key: str, where: str, *, kind: type = str, prefix: str = "") -> list[Any]:
    value = bench.get(key)
    if (
        not isinstance(value, list)
        or not value
        or not all(isinstance(v, kind) and not isinstance(v, bool) for v in value)
    ):
        name = f"bench.{prefix}.{key}" if prefix else f"bench.{key}"
        raise ConfigError(f"{where}: {name} must be a non-empty list of {kind.__name__}s; got {value!r}")
    return value


def parse_suite(name: str, data: dict[str, Any], where: str) -> Suite:
    """A suite from parsed TOML; errors name the file and the key."""
    data = copy.deepcopy(data)
    bench = data.pop("bench", None)
    if not isinstance(bench, dict):
        raise ConfigError(f"{where}: a suite needs a [bench] section with algorithms, partitions and seeds")
    known = {"algorithms", "partitions", "seeds", "variants", "overrides", "mode", "match_steps", "description",
             "paper", "scaled"}  # fmt: skip
    unknown = sorted(set(bench) - known)
    if unknown:
        raise ConfigError(
            f"{where}: unknown key(s) bench.{', bench.'.join(unknown)}; valid: {', '.join(sorted(known))}"
        )
    mode = bench.get("mode", "inprocess")
    if mode not in MODES:
        raise ConfigError(f"{where}: bench.mode must be one of {', '.join(MODES)}; got {mode!r}")
    variants = []
    for i, raw in enumerate(bench.get("variants") or [{"name": "default"}]):
        if not isinstance(raw, dict) or not isinstance(raw.get("name"), str) or not raw["name"]:
            raise ConfigError(f'{where}: bench.variants[{i}] needs a name = "..." and the sections it overrides')
        overrides = {k: v for k, v in raw.items() if k not in ("name", "algorithms")}
        only = _str_list(raw, "algorithms", where, prefix=f"variants[{i}]") if "algorithms" in raw else None
        variants.append(Variant(raw["name"], overrides, only))
    if len({v.name for v in variants}) != len(variants):
        raise ConfigError(f"{where}: bench.variants names must be unique")
    algorithms = _str_list(bench, "algorithms", where)
    for i, variant in enumerate(variants):
        stray = sorted(set(variant.algorithms or []) - set(algorithms))
        if stray:
            raise ConfigError(f"{where}: bench.variants[{i}].algorithms names {stray}, not in bench.algorithms")
    overrides = bench.get("overrides", {})
    if not isinstance(overrides, dict) or not all(isinstance(v, dict) for v in overrides.values()):
        raise ConfigError(
            f"{where}: bench.overrides.NAME must be tables of the sections that algorithm's runs override"
        )
    match_steps = bench.get("match_steps", "")
    if match_steps and match_steps not in algorithms:
        raise ConfigError(
            f"{where}: bench.match_steps must name one of bench.algorithms {algorithms}; got {match_steps!r}"
        )
    suite = Suite(
        name=name,
        base=data,
        algorithms=algorithms,
        partitions=_str_list(bench, "partitions", where),
        seeds=_str_list(bench, "seeds", where, kind=int),
        variants=variants,
        overrides=overrides,
        mode=mode,
        match_steps=match_steps,
        description=str(bench.get("description", "")),
        paper=str(bench.get("paper", "")),
        scaled=str(bench.get("scaled", "")),
    )
    try:
        suite.runs()
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from exc
    return suite


def load_suite(name: str | None = None, path: str | Path | None = None) -> Suite:
    """A shipped suite by name, or a suite file."""
    if (name is None) == (path is None):
        raise ConfigError("give either --suite NAME or --config FILE")
    if name is not None:
        if name not in shipped():
            raise ConfigError(f"unknown suite {name!r}; shipped suites: {', '.join(shipped())} (or --config FILE)")
        text = resources.files("server.experiments").joinpath("suites", f"{name}.toml").read_text()
        where = f"suite {name}"
    else:
        file = Path(path).expanduser()  # type: ignore[arg-type]
        if not file.is_file():
            raise ConfigError(f"suite file {file} does not exist")
        text, name, where = file.read_text(), file.stem, str(file)
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{where}: not valid TOML: {exc}") from exc
    return parse_suite(name, data, where)
