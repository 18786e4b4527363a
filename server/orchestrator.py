"""The round loop over MQTT: register clients, select, assign, collect until a timer deadline, aggregate, evaluate.

The deadline is a real timer (the receive loop wakes at least once a second), so a client that died cannot stall a
round; a client whose last will says it went offline is not waited for at all. Every update is checked against the
round it was assigned for before it can reach the strategy: late, foreign, duplicated, mis-shaped or incomplete
updates are rejected, logged and counted, and the round goes on; so are updates for a model version the round did
not send and deltas whose norm is absurd (``train.max_update_norm``).

The deadline is ``clients.round_deadline_s``, or derived from the previous round's slowest compute time
(``clients.deadline_factor``); each round's is recorded in its metrics row. After every round the model and the
strategy's state go to ``checkpoint.npz``; a server restarted with the same output directory and configuration
resumes after the last completed round (a different configuration is refused, naming the key that differs).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from edge_client.data import ArrayDataset
from edge_client.models import build_model, get_flat
from edge_client.protocol import (
    Assignment,
    DuplicateMessage,
    Hello,
    InvalidField,
    Message,
    MessageTooLarge,
    ModelFile,
    OutOfRound,
    Presence,
    ProtocolError,
    ShapeMismatch,
    Stop,
    Update,
    encode,
)
from edge_client.topics import Topics
from edge_client.transport import Link, LinkConfig, MqttLink
from server.config import ConfigError, RunConfig
from server.evaluation import Evaluator
from server.live_state import LiveState
from server.onnx_export import BackgroundExporter, export_onnx, read_sidecar
from server.report import MetricsLog, client_summary, plot_report, summarize, write_summary
from server.strategies import ServerContext, Strategy, TrainSettings, make_strategy
from server.strategies.base import pack_state, unpack_state

log = logging.getLogger("edgefl.server")


class UnknownModelVersion(OutOfRound):
    """An update trained on a model version the round never sent."""

    reason = "model_version"


class AbsurdNorm(InvalidField):
    """An update whose delta is far larger than any honest one (``train.max_update_norm``)."""

    reason = "norm"


#: Config keys that may change between a run and its resumption: where the broker is and how to log in.
RESUMABLE_CHANGES = ("broker.", "run.out")


def config_identity(config: RunConfig) -> dict[str, Any]:
    """The configuration as flat ``section.key`` values, minus what may change on a restart."""
    sections = {**dataclasses.asdict(config), "algorithm": {}}  # only the chosen algorithm's parameters matter
    sections[f"algorithm.{config.train.algorithm}"] = config.algorithm_params()
    flat = {f"{section}.{key}": value for section, values in sections.items() for key, value in values.items()}
    return {k: v for k, v in flat.items() if not k.startswith(RESUMABLE_CHANGES)}


class RoundObserver(Protocol):
    """Where the orchestrator reports progress (the console display, or nothing)."""

    def waiting(self, text: str) -> None: ...

    def round_done(self, row: dict[str, Any]) -> None: ...


class _Silent:
    def waiting(self, text: str) -> None:
        pass

    def round_done(self, row: dict[str, Any]) -> None:
        pass


@dataclass
class ClientRecord:
    client_id: str
    num_samples: int
    device: dict[str, Any] = field(default_factory=dict)
    online: bool = True


@dataclass
class RoundState:
    """What the collector needs to judge an update for the round in progress."""

    round: int
    model_version: int
    selected: set[str]
    received: dict[str, Update] = field(default_factory=dict)
    bytes_up: dict[str, int] = field(default_factory=dict)
    assigned_steps: dict[str, int] = field(default_factory=dict)
    deadline_s: float = 0.0


def resumes(out_dir: Path) -> bool:
    """Whether a server started on ``out_dir`` continues an unfinished run (rather than starting afresh)."""
    path = Path(out_dir) / "checkpoint.npz"
    if not path.exists():
        return False
    with np.load(path) as saved:
        return "finished" in saved.files and not bool(saved["finished"])  # no marker: written before resumption


class Orchestrator:
    def __init__(
        self,
        config: RunConfig,
        link_config: LinkConfig,
        evaluator: Evaluator,
        model_spec: dict[str, Any],
        out_dir: Path,
        *,
        observer: RoundObserver | None = None,
        summary_extra: dict[str, Any] | None = None,
        root: ArrayDataset | None = None,
        link: Link | None = None,
    ) -> None:
        self.config = config
        self.model_spec = model_spec
        self.evaluator = evaluator
        self.out_dir = out_dir
        self.observer = observer or _Silent()
        self.summary_extra = summary_extra or {}
        self.topics = Topics(config.run.job)
        t = config.train
        self.strategy: Strategy = make_strategy(
            t.algorithm,
            TrainSettings(t.local_steps, t.lr, t.batch_size, config.clients.fraction),
            config.algorithm_params(),
            config.run.seed,
            rounds=config.run.rounds,
        )
        self.root = root
        self.clients: dict[str, ClientRecord] = {}
        self.client_samples: dict[str, int] = {}  # shared with the strategy's context
        self.current: RoundState | None = None
        self.live = LiveState(out_dir, self._live_facts())  # live.json, for the dashboard
        offline = encode(Presence(client_id="server", online=False, role="server", reason="connection lost"))
        self.link: Link = link or MqttLink(
            link_config,
            f"edgefl-server-{config.run.job}",
            [self.topics.all_up],
            will=(self.topics.server, offline, True),
        )

    def _live_facts(self) -> dict[str, Any]:
        """The run facts the dashboard heads its page with."""
        run = self.config.run
        dataset = self.summary_extra.get("dataset", self.config.data.dataset)
        return {
            "algorithm": self.strategy.name,
            "dataset": dataset,
            "partition": self.config.data.partition,
            "job": run.job,
            "rounds": run.rounds,
            "target": run.target_accuracy,
        }

    # -- messages ----------------------------------------------------------------------------------------------------
    def _handle(self, topic: str, msg: Message) -> None:
        sender = self.topics.sender_of(topic)
        self.live.heard(sender)
        try:
            if sender is None:
                raise InvalidField(f"message on unexpected topic {topic!r}")
            if isinstance(msg, Hello):
                self._register(sender, msg)
            elif isinstance(msg, Presence):
                self._presence(sender, msg)
            elif isinstance(msg, Update):
                self._accept(topic, sender, msg)
            else:
                raise InvalidField(f"clients may not send {type(msg).__name__.lower()} messages")
        except ProtocolError as exc:
            self.link.reject(topic, exc)
            self.live.rejected(sender, exc.reason)

    def _register(self, sender: str, hello: Hello) -> None:
        if hello.client_id != sender:
            raise InvalidField(f"hello on the topic of {sender!r} claims client id {hello.client_id!r}")
        known = self.clients.get(sender)
        self.clients[sender] = ClientRecord(sender, hello.num_samples, hello.device, online=True)
        self.client_samples[sender] = hello.num_samples
        self.live.registered(sender, hello.device)
        if known is None or not known.online:
            log.info(
                "client %s registered: %d samples, %s",
                sender,
                hello.num_samples,
                {k: hello.device.get(k) for k in ("hostname", "machine", "cpu_count")},
            )

    def _presence(self, sender: str, presence: Presence) -> None:
        if presence.client_id != sender:
            raise InvalidField(f"presence on the topic of {sender!r} claims client id {presence.client_id!r}")
        record = self.clients.get(sender)
        if record is not None and record.online != presence.online:
            record.online = presence.online
            self.live.presence(sender, presence.online)
            log.info("client %s is %s (%s)", sender, "online" if presence.online else "offline", presence.reason)

    def _accept(self, topic: str, sender: str, update: Update) -> None:
        state = self.current
        if update.client_id != sender:
            raise InvalidField(f"update on the topic of {sender!r} claims client id {update.client_id!r}")
        if state is None or update.round != state.round:
            now = state.round if state else "no round"
            raise OutOfRound(f"update from {sender} for round {update.round} arrived during round {now}; discarded")
        if sender not in state.selected:
            raise OutOfRound(f"{sender} was not selected for round {state.round}")
        if sender in state.received:
            raise DuplicateMessage(f"second update from {sender} for round {state.round}")
        if update.model_version != state.model_version:
            raise UnknownModelVersion(
                f"{sender} trained on model version {update.model_version}, round {state.round} sent version "
                f"{state.model_version}"
            )
        if update.local_steps > state.assigned_steps[sender]:
            raise InvalidField(
                f"{sender} claims {update.local_steps} local steps; it was told {state.assigned_steps[sender]}"
            )
        if update.delta.size != self.num_params:
            raise ShapeMismatch(f"{sender}: delta has {update.delta.size} values, the model has {self.num_params}")
        norm = float(np.linalg.norm(update.delta.astype(np.float64)))
        if not norm <= self.config.train.max_update_norm:
            raise AbsurdNorm(
                f"{sender}: delta norm {norm:.4g} exceeds train.max_update_norm = {self.config.train.max_update_norm:g}"
            )
        self.strategy.check_update(update)
        state.received[sender] = update
        state.bytes_up[sender] = self.link.take_bytes_in(topic)
        log.info(
            "round %d: %s reported %d steps, compute %.3f s, cpu %.3f s, loss %.4f",
            state.round,
            sender,
            update.local_steps,
            update.compute_s,
            update.cpu_s,
            update.train_loss,
        )

    def _pump(self, timeout: float) -> None:
        received = self.link.receive(timeout)
        if received is not None:
            self._handle(*received)

    # -- phases ------------------------------------------------------------------------------------------------------
    def online(self) -> list[str]:
        return sorted(c for c, rec in self.clients.items() if rec.online)

    def wait_for_clients(self, count: int) -> None:
        deadline = time.monotonic() + self.config.clients.register_timeout_s
        while len(self.online()) < count:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"only {len(self.online())} of {count} clients registered within "
                    f"{self.config.clients.register_timeout_s:.0f} s ({self.online()}); start more clients or lower "
                    "clients.min_clients"
                )
            self.observer.waiting(f"waiting for clients: {len(self.online())}/{count} registered")
            self._pump(0.5)

    def available(self) -> list[str]:
        """Online clients the strategy has not excluded."""
        excluded = self.strategy.excluded()
        return [c for c in self.online() if c not in excluded]

    def deadline(self, slowest_compute_s: float | None) -> float:
        """This round's deadline: fixed, or factor x the last round's slowest compute time + margin, within bounds."""
        c = self.config.clients
        if not c.deadline_factor or not slowest_compute_s:  # nothing measured yet
            return c.round_deadline_s
        derived = c.deadline_factor * slowest_compute_s + c.deadline_margin_s
        return min(c.round_deadline_s, max(c.deadline_floor_s, derived))

    def _assign(
        self, round_: int, version: int, weights: np.ndarray, deadline_s: float
    ) -> tuple[RoundState, dict[str, Any]]:
        available = self.available()
        selected = self.strategy.select(round_, available)
        train_only = self.strategy.train_only(round_, available, selected)
        state = RoundState(round_, version, set(selected), deadline_s=deadline_s)
        told: dict[str, Any] = {}
        for cid in [*selected, *train_only]:
            instr = self.strategy.instructions(round_, cid)
            instr.upload = cid in state.selected
            state.assigned_steps[cid] = instr.local_steps
            assignment = Assignment(
                round=round_,
                model_version=version,
                local_steps=instr.local_steps,
                lr=instr.lr,
                batch_size=instr.batch_size,
                deadline_s=deadline_s,
                algorithm=self.strategy.name,
                model=self.model_spec,
                weights=weights if instr.weights is None else instr.weights,
                alpha=instr.alpha,
                params=instr.params,
                arrays=instr.arrays,
                upload=instr.upload,
                seed=self.config.run.seed,
            )
            self.link.take_bytes_in(self.topics.up(cid))  # bytes_up counts what arrives from here on
            told[cid] = {**instr.summary(), "bytes_down": self.link.publish(self.topics.down(cid), encode(assignment))}
        return state, told

    def _collect(self, state: RoundState) -> None:
        deadline = time.monotonic() + state.deadline_s
        while True:
            waiting = [c for c in state.selected if c not in state.received and self.clients[c].online]
            remaining = deadline - time.monotonic()
            if not waiting or remaining <= 0:
                break
            self._pump(min(remaining, 1.0))
        for cid in sorted(state.selected - set(state.received)):
            why = "went offline" if not self.clients[cid].online else f"missed the {state.deadline_s:.1f} s deadline"
            log.warning("round %d: %s %s; aggregating without it", state.round, cid, why)

    def run(self) -> dict[str, Any]:
        """Train for the configured rounds (or until the target, if asked) and write the run's outputs."""
        self.out_dir.mkdir(parents=True, exist_ok=True)
        torch.manual_seed(self.config.run.seed)
        weights = get_flat(build_model(self.model_spec))
        self.num_params = weights.size
        self.strategy.setup(
            ServerContext(self.model_spec, self.num_params, self.client_samples, self.root, self.config.run.seed)
        )
        weights, metrics = self._resume(weights)
        self.link.start()
        self.link.publish(
            self.topics.server, encode(Presence(client_id="server", online=True, role="server")), retain=True
        )
        exporter = BackgroundExporter(self.model_spec, self.out_dir / "model.onnx", on_done=self._publish_model)
        self.live.start()
        try:
            self.wait_for_clients(self.config.min_clients)
            weights = self._train(weights, metrics, exporter)
        finally:
            exporter.close()  # its last export is published before the link goes down
            self._shutdown()
            self.live.close()
        export_onnx(self.model_spec, weights, self.out_dir / "model-final.onnx", round=len(metrics.rows))
        summary = summarize(
            metrics.rows,
            self.config.run.target_accuracy,
            algorithm=self.strategy.name,
            num_params=int(self.num_params),
            clients=len(self.clients),
            rejected=dict(self.link.rejections),
            excluded=sorted(self.strategy.excluded()),
            **self.summary_extra,
            per_client=client_summary(metrics.rows),
        )
        last = metrics.rows[-1] if metrics.rows else {}
        summary.update({f"final_{k}": v for k, v in last.items() if k.startswith("accuracy_")})
        write_summary(self.out_dir / "summary.json", summary)
        if metrics.rows:
            title = f"{self.strategy.name} · {self.summary_extra.get('dataset', '')} · {len(self.clients)} clients"
            plot_report(metrics.rows, self.config.run.target_accuracy, self.out_dir / "report.png", title)
        return summary

    def _resume(self, weights: np.ndarray) -> tuple[np.ndarray, MetricsLog]:
        """The starting model and metrics log: fresh, or restored from an unfinished run's checkpoint in ``out_dir``.

        Called after ``strategy.setup`` (which initialises state that the checkpoint then overwrites). A finished
        run's directory is started afresh, as before checkpoints existed; an unfinished one with a different
        configuration is refused rather than mixed into.
        """
        path = self.out_dir / "checkpoint.npz"
        metrics = MetricsLog(self.out_dir / "metrics.jsonl")
        self.version, self.last_round, self.slowest_compute_s = 0, 0, None
        if not resumes(self.out_dir):
            metrics.path.write_text("")
            return weights, metrics
        with np.load(path) as saved:
            self._check_resumable(path, saved)
            weights = saved["weights"].astype(np.float32)
            self.version, self.last_round = int(saved["model_version"]), int(saved["round"])
            unpack_state(self.strategy, saved)
        metrics.resume(self.last_round)
        if metrics.rows:
            self.slowest_compute_s = metrics.rows[-1]["slowest_compute_s"]
        log.warning(
            "resuming from round %d (checkpoint %s, model version %d): rounds %d-%d to go",
            self.last_round,
            path,
            self.version,
            self.last_round + 1,
            self.config.run.rounds,
        )
        return weights, metrics

    def _check_resumable(self, path: Path, saved: Any) -> None:
        """Refuse to continue a run made with another configuration or model: say which key differs and what to do."""
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
        if saved["weights"].size != self.num_params:
            raise ConfigError(f"{path} holds {saved['weights'].size} parameters, this model {self.num_params}: {fix}")

    def _train(self, weights: np.ndarray, metrics: MetricsLog, exporter: BackgroundExporter) -> np.ndarray:
        start = time.monotonic() - (metrics.rows[-1]["elapsed_s"] if metrics.rows else 0.0)
        version = self.version
        best = max((r["accuracy"] for r in metrics.rows), default=-1.0)
        rejected_before = Counter(self.link.rejections)  # what arrives between rounds counts in the next one
        for round_ in range(self.last_round + 1, self.config.run.rounds + 1):
            if not self.available():
                self.wait_for_clients(len(self.online()) + 1)
            t0 = time.monotonic()
            deadline_s = self.deadline(self.slowest_compute_s)
            self.current, told = self._assign(round_, version, weights, deadline_s)
            self.live.round_started(round_, t0 - start, told)
            self._collect(self.current)
            state, self.current = self.current, None
            updates = [state.received[c] for c in sorted(state.received)]
            t_agg = time.monotonic()
            if updates:
                weights = self.strategy.aggregate(round_, weights, updates)
                if not np.all(np.isfinite(weights)):
                    raise FloatingPointError(f"round {round_}: aggregation produced non-finite weights")
                version += 1
            t_eval = time.monotonic()
            accuracy, loss = self.evaluator(weights)
            outputs = {name: self.evaluator(w) for name, w in self.strategy.outputs(weights).items()}
            done = time.monotonic()
            row = {
                "round": round_,
                "elapsed_s": done - start,
                "round_s": done - t0,
                "aggregate_s": t_eval - t_agg,
                "eval_s": done - t_eval,
                "accuracy": accuracy,
                "loss": loss,
                "clients_selected": len(state.selected),
                "clients_reported": len(updates),
                "missing": sorted(state.selected - set(state.received)),
                "slowest_compute_s": max((u.compute_s for u in updates), default=0.0),
                "deadline_s": deadline_s,
                "clients": {u.client_id: self._client_row(u, state, told) for u in updates},
                "instructions": told,
                "rejected": dict(self.link.rejections - rejected_before),  # by reason
                "excluded": sorted(self.strategy.excluded()),
                "algorithm": self.strategy.round_metrics(),
            }
            for name, (acc, lss) in outputs.items():
                row[f"accuracy_{name}"], row[f"loss_{name}"] = acc, lss
            rejected_before = Counter(self.link.rejections)
            metrics.append(row)
            self._checkpoint(weights, round_, version)
            self.slowest_compute_s = row["slowest_compute_s"] or self.slowest_compute_s
            if accuracy > best:  # model.onnx is always the best global model so far
                best = accuracy
                exporter.submit(weights, round_)
            self.observer.round_done(row)
            if self.config.run.stop_at_target and accuracy >= self.config.run.target_accuracy:
                log.info("target accuracy %.4f reached in round %d; stopping", self.config.run.target_accuracy, round_)
                break
        self._mark_finished()
        return weights

    @staticmethod
    def _client_row(u: Update, state: RoundState, told: dict[str, Any]) -> dict[str, Any]:
        return {
            "compute_s": u.compute_s,
            "cpu_s": u.cpu_s,
            "local_steps": u.local_steps,
            "num_samples": u.num_samples,
            "train_loss": u.train_loss,
            "bytes_up": state.bytes_up.get(u.client_id, 0),
            "bytes_down": told[u.client_id]["bytes_down"],
            "device": u.metrics,
        }

    def _checkpoint(self, weights: np.ndarray, round_: int, version: int, finished: bool = False) -> None:
        """The last completed round's model and algorithm state (vectors as npz arrays), replaced atomically."""
        tmp = self.out_dir / "checkpoint.tmp.npz"
        np.savez(
            tmp,
            weights=weights,
            round=round_,
            model_version=version,
            model_spec=json.dumps(self.model_spec),
            config=json.dumps(config_identity(self.config)),
            finished=finished,
            **pack_state(self.strategy),
        )
        os.replace(tmp, self.out_dir / "checkpoint.npz")

    def _mark_finished(self) -> None:
        """Flag the checkpoint so that the next run in this directory starts afresh instead of resuming."""
        path = self.out_dir / "checkpoint.npz"
        if not path.exists():
            return
        with np.load(path) as saved:
            entries = {k: saved[k] for k in saved.files}
        tmp = self.out_dir / "checkpoint.tmp.npz"
        np.savez(tmp, **{**entries, "finished": True})
        os.replace(tmp, path)

    def _publish_model(self, path: Path, round_: int) -> None:
        """Retain the newest exported model on the job's model topic, where devices fetch it."""
        meta = read_sidecar(path) or {}
        data = path.read_bytes()
        message = ModelFile(round=round_, sha256=hashlib.sha256(data).hexdigest(), meta=meta, data=data)
        try:
            self.link.publish(self.topics.model, encode(message), retain=True, chunked=False)
        except MessageTooLarge as exc:
            log.error("model.onnx of round %d not published for devices (%s); copy it to them instead", round_, exc)

    def _shutdown(self) -> None:
        try:
            self.link.publish(self.topics.broadcast, encode(Stop(reason="training finished")))
            self.link.publish(
                self.topics.server,
                encode(Presence(client_id="server", online=False, role="server", reason="stopped")),
                retain=True,
            )
            self.link.wait_published(timeout=5.0)
        finally:
            self.link.stop()
