"""The record of a run: each round's metrics row, its checkpoint, the best model's ONNX export (published for
devices), and at the end the summary and plots.

Round t's model is evaluated on the server's test set on a thread of its own while the devices train round t+1
(``server.evaluation.EvaluationWorker``): its row, stamped with the time the model was produced, is written with its
checkpoint once that evaluation is done (``produced``), so rows stay one per round and in order, and the round's time
does not include the evaluation. With ``run.stop_at_target`` the run therefore stops after the round that was training
when the target was seen. A round without a test-set evaluation is written at once. Kept apart from the round loop so
that another loop records its rounds the same way.
"""

from __future__ import annotations

import hashlib
import logging
from collections import Counter
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from edge_client.wire.messages import ModelFile, Update
from edge_client.wire.protocol import MessageTooLarge, encode
from edge_client.wire.topics import Topics
from edge_client.wire.transport import Link
from server.admission import RoundState
from server.checkpoint import Checkpoint
from server.compute_reports import ComputeReports
from server.datasets import NO_DATA
from server.deadlines import DeviceTimes
from server.distribution import Distribution
from server.dp.mechanism import Privacy
from server.evaluation import TestResult
from server.fleet_summary import device_class, fleet_summary, parallel_round_s
from server.onnx_export import BackgroundExporter, export_onnx, read_sidecar
from server.report import MetricsLog, client_summary, plot_report, summarize, write_summary
from server.roster import Roster
from server.strategies import Strategy
from server.target import Target
from server.timeline import plot_timeline

log = logging.getLogger("edgefl.server")


class RoundObserver(Protocol):
    """Where the orchestrator reports progress (the console display, or nothing)."""

    def waiting(self, text: str) -> None: ...

    def round_done(self, row: dict[str, Any]) -> None: ...


class Silent:
    """No progress display (tests, library use)."""

    def waiting(self, text: str) -> None:
        pass

    def round_done(self, row: dict[str, Any]) -> None:
        pass


@dataclass
class Produced:
    """A round's model as the round produced it, waiting for its evaluation: the metrics row so far, and what its
    checkpoint holds (the strategy's state packed right after the aggregation, before the next round changes it)."""

    row: dict[str, Any]
    weights: np.ndarray
    version: int
    state: dict[str, np.ndarray]
    evaluation: Future[TestResult] | None  # None: no test-set evaluation this round


class Recorder:
    """Writes ``metrics.jsonl``, the checkpoint, ``model.onnx``, ``summary.json`` and the plots in ``out_dir``."""

    def __init__(
        self,
        out_dir: Path,
        target: Target,
        *,
        stop_at_target: bool,
        roster: Roster,
        checkpoint: Checkpoint,
        link: Link,
        topics: Topics,
        distribution: Distribution,
        times: DeviceTimes,
        reports: ComputeReports,
        task_name: str,
        privacy: Privacy,
        observer: RoundObserver | None = None,
        secure: bool = False,
    ) -> None:
        self.out_dir = out_dir
        self.stop_at_target = stop_at_target  # run.stop_at_target: stop after the round that reached the target
        self.target = target
        self.roster = roster
        self.checkpoint = checkpoint
        self.link = link
        self.topics = topics
        self.distribution = distribution
        self.times = times
        self.reports = reports
        self.task_name = task_name
        self.privacy = privacy  # epsilon spent, in every row and the summary
        self.secure = secure  # [privacy] secure_aggregation: the summary counts the rounds aggregated securely
        self.observer: RoundObserver = observer or Silent()
        self.metrics = MetricsLog(out_dir / "metrics.jsonl")
        self.best: float | None = None
        self.exporter: BackgroundExporter | None = None  # model.onnx written on a thread of its own, then published
        self._pending: Produced | None = None  # the previous round's model, under evaluation
        self._rejected_before: Counter[str] = Counter()  # what arrives before or between rounds counts in the next one
        self.unreported_rejections: Counter[str] = Counter()  # refused after the last round's row was written

    def begin(self, resumed_round: int | None) -> float:
        """Start ``metrics.jsonl`` afresh, or keep its rows up to a resumed checkpoint's round. The run's elapsed
        seconds so far."""
        if resumed_round is None:
            self.metrics.path.write_text("")
        else:
            self.metrics.resume(resumed_round)
            self.times.replay(self.metrics.rows)
        for r in self.metrics.rows:
            self.best = self.target.of(r) if self.target.better(self.target.of(r), self.best) else self.best
        return self.metrics.rows[-1]["elapsed_s"] if self.metrics.rows else 0.0

    def row(
        self,
        round_: int,
        timing: dict[str, float],
        state: RoundState,
        predictions: dict[str, Any],
        told: dict[str, Any],
        strategy: Strategy,
        dropped: str | None,
    ) -> dict[str, Any]:
        """A closed round's metrics row before its evaluation (``timing``: the loop's clocks, seconds)."""
        updates = [state.received[c] for c in sorted(state.received)]  # without their vectors
        row = {
            "round": round_,
            **timing,
            "clients_selected": len(state.selected),
            "clients_reported": len(updates),
            "missing": sorted(state.selected - set(state.received)),
            "failed": dict(state.failed),
            "slowest_compute_s": max((u.compute_s for u in updates), default=0.0),
            "deadline_s": state.deadline_s,
            "predictions": predictions,
            "bytes_out": self.distribution.take_bytes_out(),  # the server's egress this round
            "broadcast": self.distribution.broadcast,  # the round's model went out as a model or a difference
            "clients": {u.client_id: self._client_row(u, state, told) for u in updates},
            "train_only": self.reports.drain(),
            "instructions": told,
            "rejected": self.rejected_since(),  # by reason
            "excluded": sorted(strategy.excluded()),
            "algorithm": strategy.round_metrics(),
            **self.privacy.row(round_, strategy),
        }
        if dropped:
            row["dropped"] = dropped
        return row

    def rejected_since(self) -> dict[str, int]:
        """What the link refused since the last row, by reason; from here on it counts in the next row (the devices'
        evaluation after a round's row, too)."""
        rejected = dict(self.link.rejections - self._rejected_before)
        self._rejected_before = Counter(self.link.rejections)
        return rejected

    def _client_row(self, u: Update, state: RoundState, told: dict[str, Any]) -> dict[str, Any]:
        """One admitted update's line in the round's row (``u`` as folded: its sample count is the weight it had)."""
        # every byte the device's link carried down: its assignment, the round's broadcast (the model or its
        # difference, counted once in the server's bytes_out) and any model it asked for on its own topic
        d = self.distribution
        bytes_down = told[u.client_id]["bytes_down"] + d.model_bytes + d.requested_bytes.get(u.client_id, 0)
        bytes_up = state.bytes_up.get(u.client_id, 0)
        record = self.roster.clients.get(u.client_id)
        registered = record.num_samples if record else u.num_samples
        capped = {"weight_samples": u.num_samples} if u.num_samples != registered else {}
        return {
            "device_class": device_class(record.device if record else {}),
            **self.times.record(state.round, u, bytes_down, bytes_up),
            "compute_s": u.compute_s,
            "overhead_s": min(u.overhead_s, u.compute_s),  # of compute_s: the work outside the local steps
            "cpu_s": u.cpu_s,
            "local_steps": u.local_steps,
            "num_samples": registered,
            **capped,
            "train_loss": u.train_loss,
            "bytes_up": bytes_up,
            "bytes_down": bytes_down,
            "device": u.metrics,
        }

    def produced(self, p: Produced) -> bool:
        """A round's model is produced: record the previous round's (its evaluation ran beside this round), and this
        one at once when it has nothing to wait for. True when the run should stop at the target."""
        previous, self._pending = self._pending, p
        if previous is not None and self.record(previous):
            return True
        if p.evaluation is None:
            self._pending = None
            return self.record(p)
        return False

    def finish(self) -> None:
        """The rounds are over: record the last one produced and mark the checkpoint finished."""
        if self._pending is not None:
            self.record(self._pending)
            self._pending = None
        self.checkpoint.mark_finished()
        self.unreported_rejections = self.link.rejections - self._rejected_before

    def record(self, p: Produced) -> bool:
        """Once a round's evaluation is done: its metrics row, its checkpoint, the export of a new best model and the
        progress line. True when the run should stop at the target."""
        e = p.evaluation.result() if p.evaluation is not None else None
        row = {**p.row, "eval_s": e.eval_s if e else 0.0, **(e.tested if e else {})}
        for name, result in (e.outputs if e else {}).items():
            row.update({f"{metric}_{name}": value for metric, value in result.items()})
        metrics = self.metrics
        if self.times.modelled and "parallel_elapsed_s" not in row:  # in-process: the round as long as its slowest
            # device (server.fleet_summary); a buffered step's comes from its event clock (server.buffered.clock)
            row["parallel_round_s"] = parallel_round_s(row)
            row["parallel_elapsed_s"] = row["parallel_round_s"] + (
                metrics.rows[-1]["parallel_elapsed_s"] if metrics.rows else 0.0
            )
        metrics.append(row)
        self.checkpoint.save(p.weights, row["round"], p.version, p.state, self.roster.run_id)
        value = self.target.of(row)
        if self.target.better(value, self.best):  # model.onnx is always the best global model so far
            self.best = value
            if self.exporter is None:  # started by the first export: a run that records nothing starts no thread
                self.exporter = BackgroundExporter(
                    self.roster.model_spec, self.out_dir / "model.onnx", on_done=self.publish_model, task=self.task_name
                )
            self.exporter.submit(p.weights, row["round"])
        self.observer.round_done(row)
        if self.stop_at_target and self.target.reached(value):
            log.info("target %s %s reached in round %d; stopping", self.target.metric, self.target.value, row["round"])
            return True
        return False

    def publish_model(self, path: Path, round_: int) -> None:
        """Retain the newest exported model on the job's model topic, where devices fetch it."""
        meta = read_sidecar(path) or {}
        data = path.read_bytes()
        message = ModelFile(round=round_, sha256=hashlib.sha256(data).hexdigest(), meta=meta, data=data)
        try:
            self.link.publish(self.topics.model, encode(message), retain=True, chunked=False)
        except MessageTooLarge as exc:
            log.error("model.onnx of round %d not published for devices (%s); copy it to them instead", round_, exc)

    def close(self) -> None:
        """Stop the exporter once its last export is published (before the link goes down)."""
        if self.exporter is not None:
            self.exporter.close()

    def summarize(self, weights: np.ndarray, strategy: Strategy, num_params: int, extra: dict[str, Any]
                  ) -> dict[str, Any]:  # fmt: skip
        """The final model's export, ``summary.json`` and the plots; the summary."""
        rows, clients = self.metrics.rows, self.roster.clients
        export_onnx(
            self.roster.model_spec, weights, self.out_dir / "model-final.onnx", round=len(rows), task=self.task_name
        )
        rejected = sum((Counter(r["rejected"]) for r in rows), Counter()) + self.unreported_rejections
        if self.secure:
            extra = {**extra, "secure_rounds": sum(1 for r in rows if "secure" in r and not r.get("dropped"))}
        classes = {cid: device_class(record.device) for cid, record in clients.items()}
        summary = summarize(
            rows,
            self.target,
            algorithm=strategy.name,
            run_id=self.roster.run_id,
            num_params=int(num_params),
            clients=len(clients),
            rejected=dict(rejected),
            dropped_rounds=[r["round"] for r in rows if r.get("dropped")],
            excluded=sorted(strategy.excluded()),
            **extra,
            **self.privacy.summary(rows),
            per_client=client_summary(rows),
            **fleet_summary(rows, classes, self.target),
        )
        last = rows[-1] if rows else {}
        summary.update({f"final_{k}": v for k, v in last.items() if k.startswith(f"{self.target.metric}_")})
        write_summary(self.out_dir / "summary.json", summary)
        if rows:
            title = run_title(strategy.name, extra.get("dataset", ""), len(clients))
            plot_report(rows, self.target, self.out_dir / "report.png", title)
            plot_timeline(rows, self.out_dir / "timeline.png", title, classes)
        return summary


def run_title(algorithm: str, dataset: str, clients: int) -> str:
    """The plots' title: the algorithm, whose data, how many devices; a server without data set trained on the
    devices' own data, which "none" would not say."""
    data = "devices' own data, no server data set" if dataset == NO_DATA else dataset
    return f"{algorithm} · {data} · {clients} clients"
