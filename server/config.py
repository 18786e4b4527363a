"""Run configuration: a TOML file, overridable by command-line flags, validated with errors that name the key.

```toml
[run]        rounds, target_accuracy, target, target_metric, higher_is_better, stop_at_target, seed, out, job
[clients]    count, min_clients, fraction, register_timeout_s, round_deadline_s, deadline_factor, deadline_margin_s,
             deadline_floor_s, max_samples, max_weight_share
[data]       dataset ("none": the server holds no data), partition
[model]      name, or factory = "package.module:callable", plus the model's keyword arguments (default: the data set's)
[task]       name = classification | regression | binary, or factory = "package.module:callable" plus its arguments
[eval]       mode = server | clients | both (default: server when the server has a test set), every, devices,
             deadline_s, holdout (simulated devices)
[train]      algorithm, local_steps, batch_size, lr, momentum, weight_decay, max_update_norm, max_norm_ratio,
             store_ram_mb, steps_policy, round_budget_s, tau_min, tau_max, codec, codec_policy, upload_budget_s,
             codec_ladder, downlink_codec, mode, concurrency, buffer_size, server_lr, staleness_weight,
             staleness_exponent, max_staleness
[algorithm.<name>]   that algorithm's settings, as its contract declares them (edge_client/algorithms/<name>.py)
[fleet]      devices ("pi5:2,pi4:5,pi3:3"), and [fleet.profiles.<name>] tables (server/device_profiles.py): simulated
[simulation] threads, freeloaders, attackers, attack_sigma: simulated clients only
[broker]     url, username, password, ca_file, chunk_size, max_packet_size, devices
[privacy]    mode = off | central | local, clip_norm, noise_multiplier, target_epsilon, delta, adaptive_clipping,
             target_quantile, clip_learning_rate (docs/privacy.md; checked by server/dp/settings.py),
             secure_aggregation, threshold, neighbours, quantisation_bits, stage_deadline_s (docs/secure-aggregation.md)
```

Every float key must be finite (TOML's ``inf`` and ``nan`` are refused at load, naming the key), except the keys whose
field says ``inf`` switches their check off (``INF_OFF``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import types
import typing
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tomllib

from edge_client.algorithms import CONTRACTS, contract_of
from edge_client.wire import codecs
from server.buffered.staleness import MODES, STALENESS_WEIGHTS
from server.device_profiles import fleet_size, profiles
from server.dp.settings import PrivacySection, privacy_refusal
from server.strategies.base import TrainSettings
from server.strategies.store import DEFAULT_RAM_BYTES

INF_OFF = "inf_off"  # field metadata: what ``inf`` means for a float key that may be infinite


class ConfigError(ValueError):
    """A configuration value is missing, unknown or invalid; the message names the key and the fix."""


@dataclass
class RunSection:
    rounds: int = 30  # rounds to train
    target_accuracy: float = 0.97  # classification's shorthand for target_metric = "accuracy", target = ...
    target: float | None = None  # the value of target_metric counted as reached (time-to-target)
    target_metric: str = ""  # default: the task's main metric (accuracy, rmse, auc); "loss" works for every task
    higher_is_better: bool | None = None  # default: the metric's own direction
    # true: stop once a round reaches the target (a server evaluation is seen while the next round trains, so that
    # round finishes too)
    stop_at_target: bool = False
    seed: int = 0  # seeds the partition, the held-out splits and what the run draws at random
    out: str = "runs/latest"  # the run's output directory (metrics.jsonl, summary.json, plots, checkpoint, logs)
    job: str = "default"  # topic namespace: several jobs can share one broker


@dataclass
class ClientsSection:
    count: int = 10  # simulate: client processes to start; run: devices to wait for before round 1
    min_clients: int = 0  # clients to wait for before round 1 (0: all of `count`)
    fraction: float = 1.0  # C: fraction of available clients selected per round
    register_timeout_s: float = 300.0  # the longest the server waits for its devices to register before round 1
    round_deadline_s: float = 120.0  # the longest a round waits for updates (the deadline while one is unmeasured)
    # > 0: the deadline is deadline_factor x the longest time a selected client is predicted to need (its own last
    # measured seconds per step x the steps it is told, plus its transfers: server/deadlines.py) plus
    # deadline_margin_s, never below deadline_floor_s nor above round_deadline_s; 0: always the fixed one
    deadline_factor: float = 0.0
    deadline_margin_s: float = 5.0  # seconds added to a derived deadline
    deadline_floor_s: float = 10.0  # a derived deadline never goes below this
    # a device registering with more training samples is refused: data-size weights come from the registration, so an
    # unbounded claim would let one device outweigh the fleet in FedUmf, FedVeca, FedNova, FedACG, "samples" weighting
    max_samples: int = 10_000_000
    # The largest share one device may have of a combined value: its sample weight in a round's aggregate (relative to
    # the round's selected devices) and in a combined device evaluation (relative to the devices that reported). 0.5:
    # no device outweighs all the others together, while an honest fleet's unequal shards keep their weights.
    max_weight_share: float = 0.5


@dataclass
class SimulationSection:
    """Simulated clients only (edge-server simulate and bench, the benchmarks); a server of real devices ignores it."""

    threads: int = 1  # torch threads per client process
    freeloaders: float = 0.0  # fraction of clients that are TACO freeloaders (the last ids)
    attackers: float = 0.0  # fraction of clients that scale their updates by p ~ N(0, attack_sigma^2)
    attack_sigma: float = 1.7320508  # DRAG: variance 3


#: ``section.key`` -> where it moved: read where it was, with a FutureWarning naming the new key, for one release
MOVED = {f"clients.{key}": f"simulation.{key}" for key in ("threads", "freeloaders", "attackers", "attack_sigma")}


@dataclass
class DataSection:
    # mnist | mnist-parity | fmnist | adult | shakespeare | digits | NAME:DIR | a path (docs/datasets.md); "none": the
    # server holds no data (the devices evaluate)
    dataset: str = "mnist"
    # iid | dirichlet:PHI[:balanced] | taco-groups | fedveca-case:N | drag-q:Q | shards:K | unbalanced:SIGMA | natural
    partition: str = "iid"
    label_column: str = ""  # a .csv data set: the column holding the target (edge-client run --label-column)


@dataclass
class EvalSection:
    mode: str = ""  # server | clients | both; "": server when the server holds a test set, else clients
    every: int = 1  # evaluate after every N-th round (and after the last)
    devices: str = "all"  # clients mode: all online devices with a held-out split, or only the round's selected
    deadline_s: float = 60.0  # the longest the server waits for the devices' evaluations
    # simulate and bench: the share of its shard each simulated device holds out (edge-client run --holdout);
    # 0: 0.1 when the devices evaluate (mode clients or both), else none
    holdout: float = 0.0


@dataclass
class TrainSection:
    algorithm: str = "fedavg"  # a name of docs/algorithms.md; its settings go in [algorithm.NAME]
    local_steps: int = 50  # tau: local SGD steps per client and round
    batch_size: int = 64  # local mini-batch size
    lr: float = 0.1  # local learning rate
    # the local optimiser of every algorithm: SGD, with momentum and weight decay when set (FedUmf's paper: 0.5, 5e-4)
    momentum: float = 0.0
    weight_decay: float = 0.0  # of the local optimiser (see momentum)
    # L2 norm above which an update's delta is rejected as absurd (reason "norm"): orders of magnitude above any honest
    # delta (digits/MNIST deltas are < 10), low enough to stop a blown-up or malicious one; `inf` disables the check
    max_update_norm: float = field(default=1e4, metadata={INF_OFF: "disables the check"})
    # ... and above max_norm_ratio x the median norm per local step of the previous round's admitted deltas (x the
    # update's own steps): one device cannot move the model far more than the round's honest majority; `inf` disables
    # it (round 1, and the first round after a resume, have only the fixed bound)
    max_norm_ratio: float = field(default=10.0, metadata={INF_OFF: "disables the check"})
    # MiB of a round's updates that TACO, FoolsGold, DRAG's first round and the TACO-tailored variants keep in RAM
    # until all are in; the rest go to a memory-mapped file in the run directory (0: all of them)
    store_ram_mb: int = DEFAULT_RAM_BYTES >> 20
    # "deadline": each client gets the most local steps it can finish in round_budget_s from its measured speed, in
    # [tau_min, tau_max] (server/steps_policy.py); only for algorithms whose contract tolerates unequal steps
    steps_policy: str = "fixed"
    round_budget_s: float = 0.0  # the round time the deadline policy fits (required with it)
    tau_min: int = 1  # the deadline policy's least steps
    tau_max: int = 0  # 0: train.local_steps
    # Compression (edge_client/wire/codecs.py, server/codec_policy.py). codec: what every device uploads with ("fixed"),
    # or with codec_policy = "link" what a device uploads with until its link has been measured; from then on it gets
    # the first (least lossy) codec of codec_ladder whose upload fits in upload_budget_s at its measured rate.
    codec: str = "fp32"  # fp32 | fp16 | int8[:B] | topk:F | topk:F+int8[:B] (docs/compression.md)
    codec_policy: str = "fixed"  # fixed: every device uses codec | link: per device, from its measured upload rate
    upload_budget_s: float = 0.0  # link: the longest an upload should take (seconds)
    # link: the choices, least lossy first
    codec_ladder: list[str] = field(default_factory=lambda: ["fp32", "fp16", "int8", "topk:0.1+int8", "topk:0.01+int8"])
    # "int8" (or int8:B): a device holding the previous round's model is sent the int8-coded difference instead
    downlink_codec: str = "fp32"
    # "buffered" (FedBuff, docs/buffered.md, server/buffered/): no rounds; every device trains all the time and the
    # server aggregates each buffer_size updates, weighted by their staleness; run.rounds counts aggregation steps.
    # Only for algorithms whose contract says they can (fedavg, fedprox, fednova)
    mode: str = "synchronous"
    concurrency: int = 0  # buffered: devices training at once (0: every online device)
    buffer_size: int = 3  # buffered: K, the updates each aggregation step takes
    server_lr: float = 1.0  # buffered: the step is server_lr x the staleness-weighted mean of the K updates
    # buffered: the weight w(s) of an update trained s model versions ago: "sqrt" 1/sqrt(1+s), "polynomial"
    # (1+s)^-staleness_exponent, "constant" 1
    staleness_weight: str = "sqrt"
    staleness_exponent: float = 0.5  # buffered, polynomial: the exponent a of (1+s)^-a
    max_staleness: int = 20  # buffered: an update trained more versions ago than this is refused ("staleness")


@dataclass
class FleetSection:
    """A simulated fleet of device classes (server/device_profiles.py); empty: every client is this machine."""

    devices: str = ""  # "pi5:2,pi4:5,pi3:3": classes in client order (clients.count follows when not given)
    profiles: dict[str, dict[str, Any]] = field(default_factory=dict)  # [fleet.profiles.NAME]: add or replace


@dataclass
class BrokerSection:
    url: str = ""  # empty: edgefl starts a mosquitto of its own
    username: str = "edgefl-server"  # the server's broker login
    password: str = ""  # empty: the EDGEFL_PASSWORD environment variable
    ca_file: str = ""  # the CA certificate of an mqtts:// broker
    chunk_size: int = 1 << 20  # bytes per MQTT message; larger payloads are chunked
    # Bytes: the broker's packet limit when it advertises none (ejabberd: its listener's max_payload_size; also
    # passed to simulated clients). 0: the limit the broker advertises (mosquitto does).
    max_packet_size: int = 0
    devices: list[str] = field(default_factory=list)  # device ids to create credentials for (own broker only)


@dataclass
class RunConfig:
    run: RunSection = field(default_factory=RunSection)
    clients: ClientsSection = field(default_factory=ClientsSection)
    data: DataSection = field(default_factory=DataSection)
    train: TrainSection = field(default_factory=TrainSection)
    broker: BrokerSection = field(default_factory=BrokerSection)
    fleet: FleetSection = field(default_factory=FleetSection)
    simulation: SimulationSection = field(default_factory=SimulationSection)
    eval: EvalSection = field(default_factory=EvalSection)
    privacy: PrivacySection = field(default_factory=PrivacySection)
    # name = cnn (TACO's) | fedveca-cnn | svm | mlp (in_features, num_classes, hidden) | char-lstm, or factory =
    # "package.module:callable" returning a torch.nn.Module; the other keys are its keyword arguments, input_shape
    # (one sample) is for the ONNX export. Default: the data set's model (docs/own-model.md)
    model: dict[str, Any] = field(default_factory=dict)
    # name = classification (cross-entropy; accuracy) | regression (MSE; MAE, RMSE) | binary (BCE; accuracy, AUC), or
    # factory = "package.module:callable" returning an edge_client.learning.tasks.Task (loss, metrics, main metric,
    # directions, and ranges={"loss": (0, inf), ...}: device reports outside them are refused) plus its arguments.
    # Default: classification
    task: dict[str, Any] = field(default_factory=dict)
    # each algorithm's settings as its contract declares them (edge_client/algorithms/<name>.py; docs/algorithms.md)
    algorithm: dict[str, dict[str, Any]] = field(default_factory=dict)

    @property
    def min_clients(self) -> int:
        return self.clients.min_clients or self.clients.count

    def algorithm_params(self) -> dict[str, Any]:
        return dict(self.algorithm.get(self.train.algorithm, {}))

    def train_settings(self) -> TrainSettings:
        """The run-wide training settings every strategy starts from (``[train]`` and ``clients.fraction``)."""
        t = self.train
        return TrainSettings(t.local_steps, t.lr, t.batch_size, self.clients.fraction, t.momentum, t.weight_decay)

    def bounds(self) -> list[tuple[str, bool, str]]:
        """``(section.key, holds, what it must be)`` for every bounded key: validate() refuses the first that does not
        hold, and docs/configuration.md's table shows what it must be (server/config_reference.py)."""
        c = self.clients
        return [
            ("run.rounds", self.run.rounds >= 1, "an integer >= 1"),
            ("run.target_accuracy", 0.0 < self.run.target_accuracy <= 1.0, "a fraction in (0, 1], e.g. 0.97"),
            ("clients.count", self.clients.count >= 1, "an integer >= 1"),
            ("clients.min_clients", self.clients.min_clients >= 0, "an integer >= 0 (0 means clients.count)"),
            ("clients.fraction", 0.0 < self.clients.fraction <= 1.0, "a fraction in (0, 1]"),
            ("clients.register_timeout_s", self.clients.register_timeout_s > 0, "seconds > 0"),
            ("clients.round_deadline_s", self.clients.round_deadline_s > 0, "seconds > 0"),
            ("clients.deadline_factor", self.clients.deadline_factor >= 0, "a number >= 0 (0: fixed deadline)"),
            ("clients.deadline_margin_s", self.clients.deadline_margin_s >= 0, "seconds >= 0"),
            (
                "clients.deadline_floor_s",
                c.deadline_floor_s > 0 and (not c.deadline_factor or c.deadline_floor_s <= c.round_deadline_s),
                f"seconds > 0, and <= clients.round_deadline_s ({c.round_deadline_s:g}) when "
                "clients.deadline_factor is set",
            ),
            ("clients.max_samples", self.clients.max_samples >= 1, "an integer >= 1"),
            ("clients.max_weight_share", 0.0 < c.max_weight_share <= 1.0, "a fraction in (0, 1] (1: no cap)"),
            ("train.local_steps", self.train.local_steps >= 1, "an integer >= 1"),
            ("train.batch_size", self.train.batch_size >= 1, "an integer >= 1"),
            ("train.lr", self.train.lr > 0, "a number > 0"),
            ("train.momentum", 0.0 <= self.train.momentum < 1.0, "a number in [0, 1)"),
            ("train.weight_decay", self.train.weight_decay >= 0.0, "a number >= 0"),
            ("train.max_update_norm", self.train.max_update_norm > 0, "a number > 0 (inf disables the check)"),
            ("train.max_norm_ratio", self.train.max_norm_ratio >= 1, "a number >= 1 (inf disables the check)"),
            ("train.store_ram_mb", self.train.store_ram_mb >= 0, "MiB >= 0 (0: every stored update goes to the file)"),
            ("train.steps_policy", self.train.steps_policy in ("fixed", "deadline"), "'fixed' or 'deadline'"),
            ("train.round_budget_s", self.train.round_budget_s >= 0, "seconds >= 0"),
            ("train.tau_min", self.train.tau_min >= 1, "an integer >= 1"),
            (
                "train.tau_max",
                self.train.tau_max == 0 or self.train.tau_max >= self.train.tau_min,
                f"0 (train.local_steps) or an integer >= train.tau_min ({self.train.tau_min})",
            ),
            ("train.codec_policy", self.train.codec_policy in ("fixed", "link"), "'fixed' or 'link'"),
            (
                "train.upload_budget_s",
                self.train.upload_budget_s > 0
                if self.train.codec_policy == "link"
                else self.train.upload_budget_s >= 0,
                "seconds > 0 when train.codec_policy = 'link' (the longest an upload should take)",
            ),
            ("train.codec_ladder", bool(self.train.codec_ladder), "a non-empty list of codecs, least lossy first"),
            (
                "train.downlink_codec",
                self.train.downlink_codec == "fp32" or self.train.downlink_codec.split(":")[0] == "int8",
                "'fp32' (the full model) or 'int8' / 'int8:B' (the difference from the previous round's model)",
            ),
            ("train.mode", self.train.mode in MODES, " or ".join(repr(m) for m in MODES)),
            ("train.concurrency", self.train.concurrency >= 0, "an integer >= 0 (0: every online device)"),
            ("train.buffer_size", self.train.buffer_size >= 1, "an integer >= 1 (updates per aggregation step)"),
            ("train.server_lr", self.train.server_lr > 0, "a number > 0 (1: the plain weighted mean)"),
            (
                "train.staleness_weight",
                self.train.staleness_weight in STALENESS_WEIGHTS,
                " or ".join(repr(k) for k in STALENESS_WEIGHTS),
            ),
            ("train.staleness_exponent", self.train.staleness_exponent >= 0, "a number >= 0"),
            ("train.max_staleness", self.train.max_staleness >= 0, "an integer >= 0 (model versions)"),
            ("eval.mode", self.eval.mode in ("", "server", "clients", "both"), '"server", "clients" or "both"'),
            ("eval.every", self.eval.every >= 1, "an integer >= 1"),
            ("eval.devices", self.eval.devices in ("all", "selected"), '"all" or "selected"'),
            ("eval.deadline_s", self.eval.deadline_s > 0, "seconds > 0"),
            ("eval.holdout", 0 <= self.eval.holdout < 1, "a fraction in [0, 1)"),
            ("simulation.threads", self.simulation.threads >= 1, "an integer >= 1"),
            ("simulation.freeloaders", 0.0 <= self.simulation.freeloaders <= 1.0, "a fraction in [0, 1]"),
            ("simulation.attackers", 0.0 <= self.simulation.attackers <= 1.0, "a fraction in [0, 1]"),
            ("simulation.attack_sigma", self.simulation.attack_sigma > 0, "a number > 0"),
            ("broker.chunk_size", self.broker.chunk_size >= 1024, "bytes >= 1024"),
            (
                "broker.max_packet_size",
                self.broker.max_packet_size == 0 or self.broker.max_packet_size >= 4096,
                "bytes >= 4096, or 0 to use the limit the broker advertises",
            ),
        ]

    def validate(self) -> RunConfig:
        self._validate_finite()
        for key, ok, expected in self.bounds():
            if not ok:
                section, name = key.split(".")
                value = getattr(getattr(self, section), name)
                raise ConfigError(f"{key} must be {expected}; got {value!r}")
        named = [("train.codec", self.train.codec), ("train.downlink_codec", self.train.downlink_codec)]
        for key, text in [*named, *(("train.codec_ladder", c) for c in self.train.codec_ladder)]:
            try:
                codecs.parse(text)
            except ValueError as exc:
                raise ConfigError(f"{key}: {exc}") from None
        for name, params in {self.train.algorithm: {}, **self.algorithm}.items():
            try:
                contract_of(name).resolve(params)
            except ValueError as exc:  # the contract's own message: <algorithm>.<key> = value: expected ...
                where = (
                    "train.algorithm"
                    if name == self.train.algorithm and name not in self.algorithm
                    else (f"[algorithm.{name}]")
                )
                raise ConfigError(f"{where}: {exc}") from None
        self._validate_steps_policy()
        self._validate_mode()
        self._validate_fleet()
        refusal = privacy_refusal(
            self.privacy, self.clients.count, self.train.algorithm, self.algorithm_params(), self.train.steps_policy
        )
        if refusal is not None:
            raise ConfigError(refusal)
        return self

    def _validate_finite(self) -> None:
        """Every float of every section is finite, unless its field says what ``inf`` means (nan never is)."""
        for key, value, f in float_keys(self):
            inf_off = f.metadata.get(INF_OFF, "")
            if value is None or math.isfinite(value) or (inf_off and value == math.inf):
                continue
            allowed = f" (inf {inf_off})" if inf_off else ""
            raise ConfigError(
                f"{key} must be a finite number{allowed}; got {value!r}: set a finite number"
                + ("" if f.default is None else f" (default {f.default!r})")
            )

    def _validate_steps_policy(self) -> None:
        """The deadline policy (server/steps_policy.py) needs a budget, and an algorithm whose contract tolerates
        unequal steps."""
        train = self.train
        if train.steps_policy != "deadline":
            return
        if train.round_budget_s <= 0:
            raise ConfigError(
                "train.round_budget_s must be seconds > 0 with train.steps_policy = 'deadline' (the round time to fit)"
            )
        if contract_of(train.algorithm).unequal_steps:  # an unknown algorithm was refused on its own key before
            return
        tolerant = ", ".join(sorted(name for name, c in CONTRACTS.items() if c.unequal_steps))
        raise ConfigError(
            f"train.steps_policy = 'deadline' gives clients different local step counts, which {train.algorithm} "
            "cannot aggregate: it averages raw updates, so the model would drift towards the objective of the clients "
            "that ran more steps (objective inconsistency, as the FedNova paper shows). Use it with an algorithm whose "
            f"aggregation normalises by each client's steps ({tolerant}), or keep train.steps_policy = 'fixed'"
        )

    def _validate_mode(self) -> None:
        why = self._mode_refusal()
        if why:
            raise ConfigError(why)

    def _mode_refusal(self) -> str | None:
        """Why ``train.mode = "buffered"`` cannot run with the rest of the config (naming the key and the fix)."""
        t = self.train
        if t.mode != "buffered":
            return None
        contract = CONTRACTS.get(t.algorithm)
        if contract is None:
            return None  # the unknown algorithm is reported on its own key
        if not contract.buffered:
            can = ", ".join(sorted(n for n, c in CONTRACTS.items() if c.buffered))
            return (
                f"train.mode = 'buffered' cannot run {t.algorithm}: {contract.buffered_why}. Use train.algorithm = one "
                f"of {can}, or train.mode = 'synchronous'"
            )
        if self.clients.fraction != 1.0:
            return (
                f"clients.fraction = {self.clients.fraction:g} selects devices per round, which buffered mode has "
                "not: set train.concurrency (devices training at once) and leave clients.fraction at 1"
            )
        if self.privacy.mode != "off":
            return (
                f"privacy.mode = {self.privacy.mode!r}: differential privacy accounts a round of sampled devices, "
                "which buffered mode has not; use train.mode = 'synchronous' with privacy, or privacy.mode = 'off'"
            )
        if self.privacy.secure_aggregation:
            return (
                "privacy.secure_aggregation = true: its stages run over a round's devices together, which buffered "
                "mode has not; use train.mode = 'synchronous' with it, or privacy.secure_aggregation = false"
            )
        if self.eval.mode in ("clients", "both"):
            return (
                f"eval.mode = {self.eval.mode!r}: the devices' evaluation is not available in buffered mode yet "
                "(a device is always training); use eval.mode = 'server'"
            )
        return None

    def _validate_fleet(self) -> None:
        try:
            profiles(self.fleet.profiles)
            if self.fleet.devices:
                size = fleet_size(self.fleet.devices, self.fleet.profiles)
                if size != self.clients.count:
                    raise ValueError(
                        f"it names {size} devices but clients.count = {self.clients.count}; make them agree (leave "
                        "clients.count out and it follows the fleet)"
                    )
        except ValueError as exc:
            raise ConfigError(f"fleet.devices = {self.fleet.devices!r}: {exc}") from None


SECTIONS = {f.name: f for f in dataclasses.fields(RunConfig)}


def float_keys(config: RunConfig) -> list[tuple[str, float | None, dataclasses.Field[Any]]]:
    """``(section.key, value, field)`` for every float field of every section dataclass (``field.metadata[INF_OFF]``
    says what ``inf`` means where it is allowed)."""
    out = []
    for section in dataclasses.fields(RunConfig):
        instance = getattr(config, section.name)
        if not dataclasses.is_dataclass(instance):
            continue  # free-form tables ([model], [task], [algorithm.*]): checked by what reads them
        hints = typing.get_type_hints(type(instance))
        for f in dataclasses.fields(instance):
            if float in (hints[f.name], *typing.get_args(hints[f.name])):
                out.append((f"{section.name}.{f.name}", getattr(instance, f.name), f))
    return out


def _check_type(key: str, value: Any, expected: Any) -> Any:
    """Coerce ints to floats where a float is expected; refuse everything else that does not match."""
    if isinstance(expected, types.UnionType):  # X | None: TOML has no null, so a value given is an X
        expected = next(t for t in typing.get_args(expected) if t is not type(None))
    if expected is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if expected in (int, float, str, bool) and (type(value) is not expected):
        raise ConfigError(f"{key} must be of type {expected.__name__}; got {value!r} ({type(value).__name__})")
    if expected == list[str] and not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
        raise ConfigError(f"{key} must be a list of strings; got {value!r}")
    return value


def _fill(section_name: str, instance: Any, values: dict[str, Any]) -> None:
    hints = typing.get_type_hints(type(instance))
    for key, value in values.items():
        if key not in hints:
            raise ConfigError(
                f"unknown key '{section_name}.{key}'; valid keys in [{section_name}]: {', '.join(sorted(hints))}"
            )
        setattr(instance, key, _check_type(f"{section_name}.{key}", value, hints[key]))


def moved_keys(data: dict[str, Any]) -> dict[str, Any]:
    """``data`` with the keys of ``MOVED`` in their new sections, each move a FutureWarning that names the new key."""
    out = {name: dict(values) if isinstance(values, dict) else values for name, values in data.items()}
    for old, new in MOVED.items():
        (old_section, key), (new_section, new_key) = old.split("."), new.split(".")
        section = out.get(old_section)
        if not isinstance(section, dict) or key not in section:
            continue
        target = out.setdefault(new_section, {})
        if not isinstance(target, dict):
            continue  # from_dict refuses the section itself
        if new_key in target:
            raise ConfigError(f"{old} and {new} are both given; {old} is the old name of {new}: keep only {new}")
        warnings.warn(
            f"{old} is now {new}: move it to [{new_section}] ({old} is read until the next release)",
            FutureWarning,
            stacklevel=3,
        )
        target[new_key] = section.pop(key)
    return out


def from_dict(data: dict[str, Any]) -> RunConfig:
    config = RunConfig()
    data = moved_keys(data)
    for name, values in data.items():
        if name not in SECTIONS:
            raise ConfigError(f"unknown section [{name}]; valid sections: {', '.join(sorted(SECTIONS))}")
        if not isinstance(values, dict):
            raise ConfigError(f"[{name}] must be a table of keys, got {values!r}")
        if name in ("model", "task"):
            setattr(config, name, dict(values))
        elif name == "fleet":
            fleet = dict(values)
            tables = fleet.pop("profiles", {})
            if not isinstance(tables, dict):
                raise ConfigError("[fleet.profiles.NAME] must be tables of cpu_share, uplink_mbps, downlink_mbps")
            config.fleet.profiles = {k: v for k, v in tables.items()}
            _fill(name, config.fleet, fleet)
        elif name == "algorithm":
            for algo, params in values.items():
                if not isinstance(params, dict):
                    raise ConfigError(f"[algorithm.{algo}] must be a table of that algorithm's parameters")
            config.algorithm = {k: dict(v) for k, v in values.items()}
        else:
            _fill(name, getattr(config, name), values)
    follow_fleet(config, "count" in data.get("clients", {}))
    return config.validate()


def follow_fleet(config: RunConfig, count_given: bool) -> None:
    """``clients.count`` follows ``fleet.devices`` when it was not given itself."""
    if config.fleet.devices and not count_given:
        with contextlib.suppress(ValueError):  # validate() reports it, naming the key
            config.clients.count = fleet_size(config.fleet.devices, config.fleet.profiles)


def load_config(path: str | Path | None) -> RunConfig:
    """The configuration in ``path`` (all defaults when None)."""
    if path is None:
        return RunConfig().validate()
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path} is not valid TOML: {exc}") from None
    try:
        return from_dict(data)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None


def override(config: RunConfig, **flags: Any) -> RunConfig:
    """Apply command-line flags given as ``section__key=value`` (None means not given)."""
    for name, value in flags.items():
        if value is None:
            continue
        section, key = name.split("__")
        _fill(section, getattr(config, section), {key: value})
    if flags.get("fleet__devices") is not None:
        follow_fleet(config, flags.get("clients__count") is not None)
    return config.validate()
