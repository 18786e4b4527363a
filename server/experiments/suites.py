"""Benchmark suites: a base run configuration and the grid of algorithms x partitions x seeds (x variants) to run on it.

A suite is a TOML file: the sections of a run configuration (``[run]``, ``[clients]``, ``[data]``, ``[train]``,
``[model]``, ``[algorithm.NAME]``, ``[simulation]``) plus a ``[bench]`` section::

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

A row may be one algorithm in a configuration of its own: ``"fedveca@deadline"`` in ``algorithms`` runs FedVeca with
the overrides of ``[bench.overrides."fedveca@deadline"]`` on top of FedVeca's (``fedveca`` alone is another row).

More seeds for chosen rows, some of them known only from the results (the fleet leaderboard: every row once, FedAvg
and the three fastest three times)::

    more_seeds = [1, 2]                      # run these seeds too, for
    more_seeds_for = ["fedavg", "best:3"]    # these rows, and the 3 best others of the ranking column

``best:N`` stands for the N rows, other than those named beside it, that reached the target soonest (on the clock of
their mode; none reached: highest final accuracy) in the ranking column, the first variant's first partition at the
first seed; a variant may name rows the same way (``algorithms = ["fedavg", "best:1"]``). Rows that depend on the
ranking run after every other. A variant may also run in another mode than the suite's (``mode = "broker"``) and
with seeds of its own (``seeds = [0]``: only these, no more_seeds).

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
BEST = "best:"


def algorithm_of(row: str) -> str:
    """The algorithm a row runs: ``fedveca`` for ``fedveca@deadline``."""
    return row.partition("@")[0]


def _best_count(name: str) -> int | None:
    """N of a ``best:N`` placeholder, else None."""
    if not name.startswith(BEST):
        return None
    n = name[len(BEST) :]
    return int(n) if n.isdigit() and int(n) > 0 else None


def best_of(names: list[str], ranking: list[str] | None) -> list[str]:
    """The rows each ``best:N`` of ``names`` stands for: the N best of ``ranking`` that ``names`` does not name
    otherwise (none before there is a ranking)."""
    out: list[str] = []
    for n in names:
        count = _best_count(n)
        if count is not None and ranking is not None:
            out += [r for r in ranking if r not in names and r not in out][:count]
    return out


@dataclass
class Variant:
    name: str
    overrides: dict[str, Any] = field(default_factory=dict)
    algorithms: list[str] | None = None  # None: all of the suite's
    mode: str | None = None  # None: the suite's
    seeds: list[int] | None = None  # None: the suite's, and its more_seeds; else only these


@dataclass
class RunSpec:
    """One cell of the grid: what to run and where its outputs go (relative to the bench's output directory)."""

    variant: str
    partition: str
    algorithm: str  # the row: an algorithm, or algorithm@configuration
    seed: int
    config: RunConfig
    mode: str = "inprocess"

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
    more_seeds: list[int] = field(default_factory=list)
    more_seeds_for: list[str] = field(default_factory=list)

    def use_fleet(self, devices: str) -> None:
        """Run every cell on this fleet (``bench --fleet``); the client count follows it."""
        self.base = _merge(self.base, {"fleet": {"devices": devices}})
        self.base.get("clients", {}).pop("count", None)
        for variant in self.variants:
            variant.overrides.get("clients", {}).pop("count", None)

    def ranked(self) -> bool:
        """Whether some runs depend on the ranking of the first ones (``best:N``)."""
        names = self.more_seeds_for if self.more_seeds else []
        return any(_best_count(n) for n in [*names, *(n for v in self.variants for n in v.algorithms or [])])

    def ranking_column(self) -> str:
        """The column whose first seed ranks the rows for ``best:N``."""
        return self.runs()[0].column

    def use_rounds(self, rounds: int) -> None:
        """Every run this many rounds (``bench --rounds``: a quick check)."""
        for data in [self.base, *(v.overrides for v in self.variants), *self.overrides.values()]:
            data.get("run", {}).pop("rounds", None)
        self.base = _merge(self.base, {"run": {"rounds": rounds}})

    def runs(self, ranking: list[str] | None = None, mode: str | None = None) -> list[RunSpec]:
        """Every run, each validated; all algorithms of a column share the partition and seeds. Without ``ranking``,
        the runs of ``best:N`` rows are left out; ``mode`` (``bench --mode``) overrides every variant's."""
        out = []
        more_for = [*self.more_seeds_for, *best_of(self.more_seeds_for, ranking)] if self.more_seeds else []
        for variant in self.variants:
            rows = [a for a in self.algorithms if variant.algorithms is None or a in variant.algorithms]
            rows += [a for a in best_of(variant.algorithms or [], ranking) if a not in rows]
            seeds = variant.seeds or [*self.seeds, *(s for s in self.more_seeds if s not in self.seeds)]
            for partition in self.partitions:
                for seed in seeds:
                    for row in rows:
                        if seed not in (variant.seeds or self.seeds) and row not in more_for:
                            continue
                        algorithm = algorithm_of(row)
                        data = _merge(self.base, variant.overrides)
                        data = _merge(data, self.overrides.get(algorithm, {}))
                        if row != algorithm:
                            data = _merge(data, self.overrides.get(row, {}))
                        data = _merge(
                            data,
                            {
                                "run": {"seed": seed, "job": f"bench-{self.name}"},
                                "data": {"partition": partition},
                                "train": {"algorithm": algorithm},
                            },
                        )
                        run_mode = mode or variant.mode or self.mode
                        out.append(RunSpec(variant.name, partition, row, seed, from_dict(data), run_mode))
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
             "paper", "scaled", "more_seeds", "more_seeds_for"}  # fmt: skip
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
        overrides = {k: v for k, v in raw.items() if k not in ("name", "algorithms", "mode", "seeds")}
        only = _str_list(raw, "algorithms", where, prefix=f"variants[{i}]") if "algorithms" in raw else None
        seeds = _str_list(raw, "seeds", where, kind=int, prefix=f"variants[{i}]") if "seeds" in raw else None
        if raw.get("mode", "inprocess") not in MODES:
            raise ConfigError(f"{where}: bench.variants[{i}].mode must be one of {', '.join(MODES)}")
        variants.append(Variant(raw["name"], overrides, only, raw.get("mode"), seeds))
    if len({v.name for v in variants}) != len(variants):
        raise ConfigError(f"{where}: bench.variants names must be unique")
    algorithms = _str_list(bench, "algorithms", where)
    more_seeds = _str_list(bench, "more_seeds", where, kind=int) if "more_seeds" in bench else []
    more_for = _str_list(bench, "more_seeds_for", where) if "more_seeds_for" in bench else []
    for key, names in [("more_seeds_for", more_for), *((f"variants[{i}].algorithms", v.algorithms or [])
                                                       for i, v in enumerate(variants))]:  # fmt: skip
        stray = sorted(n for n in set(names) - set(algorithms) if _best_count(n) is None)
        if stray:
            raise ConfigError(
                f"{where}: bench.{key} names {stray}, not in bench.algorithms (or best:N, the N best rows)"
            )
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
        more_seeds=more_seeds,
        more_seeds_for=more_for,
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
