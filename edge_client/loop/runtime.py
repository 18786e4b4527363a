"""The device runtime: register with the server, train on each assignment, report the update.

``EdgeClient`` is also the Python API for applications that bring their own model and data::

    client = EdgeClient("pi-kitchen", my_dataset, LinkConfig("mqtts://broker:8883", "pi-kitchen", password),
                        model_factory=lambda spec: MyNet())
    client.run()  # serves the job's runs until the process is stopped; run(once=True): until its run ends
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
from torch import nn

from edge_client.algorithms import client_algorithm
from edge_client.algorithms.base import ClientAlgorithm
from edge_client.learning.data import ArrayDataset, BatchSampler
from edge_client.learning.factories import NOTHING, AllowedCode
from edge_client.learning.flat import FlatModel
from edge_client.learning.models import build_model, fingerprint, parameter_layout
from edge_client.learning.tasks import Task, build_task, evaluate, task_loss
from edge_client.loop import device
from edge_client.loop.compression import Uplink
from edge_client.loop.dp import noise_std
from edge_client.loop.models_cache import DEFAULT_WAIT_S, ModelCache, Waiting
from edge_client.loop.session import Session
from edge_client.loop.trainer import TrainResult, prepare_process, train_local
from edge_client.wire.messages import (
    Ack,
    Assignment,
    ComputeReport,
    Evaluate,
    Evaluation,
    Failure,
    GlobalModel,
    Hello,
    Message,
    ModelRequest,
    Presence,
    Refusal,
    Resync,
    RoundFacts,
    SecAggRelay,
    SecAggRoster,
    SecAggUnmask,
    Stop,
    Update,
)
from edge_client.wire.plan import Plan
from edge_client.wire.protocol import encode
from edge_client.wire.topics import Topics, validate_client_id
from edge_client.wire.transport import Link, LinkConfig, MqttLink

if TYPE_CHECKING:  # imported when a round is secure: it needs the optional cryptography package
    from edge_client.secagg.client import SecureClient

log = logging.getLogger(__name__)

ModelFactory = Callable[[dict[str, Any]], nn.Module]
#: How many parameters of its layout a device sends at registration (the digest covers all of them).
LAYOUT_SENT = 500


class Refused(RuntimeError):
    """The server refused this device at registration; the message says why (e.g. which model parameter differs)."""


#: Builds the client's link from its subscriptions and the hook to call on every (re)connect (in-process runs).
LinkFactory = Callable[[list[str], Callable[[], None]], Link]
#: One round of local training (``trainer.train_local``; experiments wrap it to simulate dishonest clients).
TrainFn = Callable[[FlatModel, np.ndarray, ArrayDataset, BatchSampler, Plan, ClientAlgorithm, RoundFacts], TrainResult]


class Stateful(Protocol):
    """State kept in ``state_dir`` across restarts: an algorithm's, or the upload residuals."""

    def state_dict(self) -> dict[str, np.ndarray]: ...

    def load_state_dict(self, state: dict[str, np.ndarray]) -> None: ...


class EdgeClient:
    """One device: its identity, its local data, and one MQTT link to the broker."""

    def __init__(
        self,
        client_id: str,
        dataset: ArrayDataset,
        link_config: LinkConfig | None,
        *,
        job: str = "default",
        model_factory: ModelFactory | None = None,
        threads: int = 1,
        state_dir: Path | None = None,
        link_factory: LinkFactory | None = None,
        train: TrainFn = train_local,
        holdout: ArrayDataset | None = None,
        allowed: AllowedCode = NOTHING,
        model_wait_s: float = DEFAULT_WAIT_S,
        device_class: str | None = None,
        snapshot: Callable[[], dict[str, Any]] = device.snapshot,
    ) -> None:
        """``holdout``: the split this device evaluates the global model on (never trained on); ``allowed``: where a
        model or task factory the server names may be imported from (``edge_client.learning.factories``);
        ``model_wait_s``: how long an assignment waits for its round's model before the server is asked for it;
        ``snapshot``: the device's metrics around training (a simulated device's differ from this machine's: its
        throttling flags)."""
        self.client_id = validate_client_id(client_id)
        self.device_class = device_class  # e.g. "pi4": said in the hello, so the server reports per device class
        self.dataset = dataset
        self.holdout = holdout
        self.allowed = allowed
        self.topics = Topics(job)
        self.model_factory = model_factory or (lambda spec: build_model(spec, allowed))
        self.threads = threads
        self.state_dir = state_dir
        self.train = train
        self.snapshot = snapshot
        self.rounds_done = 0
        self.once = False  # run(once=True): leave after the first run that ends
        self.session = Session()  # the current run, unanswered reports, whether to ask for the assignment
        # (run id, round, assignment msg id) of the newest round this device served: an assignment of that run for an
        # older round than the one before it, or that very assignment again, is stale (replayed from the broker
        # session); a new assignment for either of the two newest rounds is a resumed server re-running it (its
        # checkpoint is written once a round's evaluation, beside the next round, is done). Kept in state_dir.
        self.served: tuple[str, int, str] = self._load_served()
        self._model: FlatModel | None = None
        self._model_spec: dict[str, Any] | None = None
        self._server_model: dict[str, Any] | None = None  # the spec the server announced; hello needs it
        self._tasks: dict[str, Task] = {}
        self.refusal: str | None = None
        self._sampler: BatchSampler | None = None
        self._sampler_key: tuple[int, int] | None = None
        self._algorithms: dict[str, ClientAlgorithm] = {}
        self._last_upload: dict[str, float] = {}
        self.uplink = Uplink(self.client_id)  # top-k residuals survive a restart like an algorithm's state
        self._load_state("uplink", self.uplink)
        self.models = ModelCache()
        self.model_wait_s = model_wait_s
        self._waiting: Waiting | None = None
        self._secure: SecureClient | None = None  # once a round is secure (it needs the `secure` extra)
        subscriptions = [
            self.topics.down(self.client_id),
            self.topics.broadcast,
            self.topics.server,
            self.topics.round_model_frames,
        ]
        self.link: Link
        if link_factory is not None:
            self.link = link_factory(subscriptions, self._connected)
        elif link_config is None:
            raise ValueError("EdgeClient needs a link_config (the broker to use) or a link_factory")
        else:
            will = encode(Presence(client_id=self.client_id, online=False, reason="connection lost"))
            self.link = MqttLink(
                link_config,
                f"edgefl-{job}-{self.client_id}",
                subscriptions,
                will=(self.topics.up(self.client_id), will, False),
                on_connect=self._connected,
                retained_once=[self.topics.round_model_frames],
            )

    def _connected(self) -> None:
        """Every (re)connect (on the link's thread): register, and let the main loop catch up (``_catch_up``)."""
        hello = self._hello()
        self.session.connected(self.link.session_present, hello.msg_id)
        self.link.publish(self.topics.up(self.client_id), encode(hello))

    def _hello(self) -> Hello:
        """Registration, with this device's model for the spec the server announced. Before any announcement (its
        retained copy may be on another node of a broker cluster) the hello states no model: the server answers it
        with its presence on this device's own topic, and the hello that follows states the model."""
        model: dict[str, Any] = {}
        if self._server_model is not None:
            try:
                layout = parameter_layout(self._model_for(self._server_model).module)
                model = {"digest": fingerprint(layout), "layout": layout[:LAYOUT_SENT]}
            except Exception as exc:  # the server says so in its refusal, and its log names this device
                log.error("cannot build the server's model %s: %s", self._server_model, exc)
                model = {"error": str(exc)[:1000]}
        return Hello(
            client_id=self.client_id,
            num_samples=len(self.dataset),
            device=device.device_info() | ({"device_class": self.device_class} if self.device_class else {}),
            model=model,
            eval_samples=len(self.holdout) if self.holdout is not None else 0,
        )

    def _say_hello(self) -> None:
        hello = self._hello()
        self.session.sending(hello.msg_id, hello.TYPE)
        self.link.publish(self.topics.up(self.client_id), encode(hello))

    def _catch_up(self) -> None:
        """Send again the report the server has not answered, and ask for the round's assignment, when due."""
        payload = self.session.due()
        if payload is not None:
            self.link.publish(self.topics.up(self.client_id), payload)
        if self.session.ask():
            run, round_, _ = self.served
            resync = Resync(self.client_id, self.session.since, round_, run)
            self.session.sending(resync.msg_id, resync.TYPE)
            self.link.publish(self.topics.up(self.client_id), encode(resync))

    def _report(self, report: Update | Failure, payload: bytes | bytearray, deadline_s: float) -> int:
        """Send an update or failure report (``payload``: it encoded); pending until the server answers it."""
        self.session.sent(report, payload, deadline_s)
        return self.link.publish(self.topics.up(self.client_id), payload)

    def run(self, max_rounds: int | None = None, *, once: bool = False) -> None:
        """Serve the job's runs: one after another until the process is stopped, or ``once``: until the run this
        device takes part in ends (or ``max_rounds`` updates were sent)."""
        prepare_process(self.threads)
        self.once = once
        self.link.start()
        log.info("%s connected with %d samples; waiting for assignments", self.client_id, len(self.dataset))
        try:
            while max_rounds is None or self.rounds_done < max_rounds:
                self._catch_up()
                received = self.link.receive(timeout=1.0)
                if received is not None and not self.handle(received[1]):
                    break
                self._check_waiting()
            self.link.wait_published(timeout=30.0)
            if self.refusal is not None:
                raise Refused(self.refusal)
        finally:
            self.link.publish(
                self.topics.up(self.client_id), encode(Presence(client_id=self.client_id, online=False, reason="done"))
            )
            self.link.wait_published(timeout=5.0)
            self.link.stop()

    def handle(self, msg: Message) -> bool:
        """Act on one message from the server; False once the run this device took part in ended and ``once``."""
        waited: Assignment | None = None
        if isinstance(msg, Stop):
            if self.session.stop(msg):
                self._waiting = None  # the run ended: its model is not owed any more
                log.info("left run %s; %s", msg.run_id, "exiting (--once)" if self.once else "waiting for the next run")
                return not self.once
        elif isinstance(msg, Refusal):
            self.refusal = f"the server refused {self.client_id} ({msg.reason}): {msg.detail}"
            log.error("%s", self.refusal)
            return False
        elif isinstance(msg, Presence) and msg.role == "server":
            if msg.online:
                self._server_model = dict(msg.model)
                self._say_hello()  # the server (re)started: register again
            waited = self.session.server(msg)
        elif isinstance(msg, Ack):
            waited = self.session.acked(msg)
        elif isinstance(msg, GlobalModel):
            self._take_model(msg)
        elif isinstance(msg, Assignment) and self.session.admit(msg):
            self._serve(msg)
        elif isinstance(msg, Evaluate):
            self._evaluate(msg)
        elif isinstance(msg, (SecAggRoster, SecAggRelay, SecAggUnmask)) and self._secure is not None:
            self._secure.handle(msg)
        if waited is not None and self.session.admit(waited):
            self._serve(waited)
        return True

    def _take_model(self, model: GlobalModel) -> None:
        """Keep a verified model; serve the assignment waiting for it, ask for the full model when a difference gave
        none, or report one whose full model does not verify."""
        ok = self.models.add(model)
        waiting = self._waiting
        if waiting is not None and waiting.assignment.facts.sha256 == model.sha256:
            if ok:
                self._waiting = None
                self._serve(waiting.assignment)
            elif model.diff_base:
                self._check_waiting()  # asks for the full model now, unless it asked already
            else:
                self._waiting = None
                a = waiting.assignment.facts
                detail = ValueError(f"model {model.sha256} does not hash to it")
                self._fail(a.round, a.run_id, "model_hash", detail, a.deadline_s)

    def _check_waiting(self) -> None:
        """Ask the server for a model that did not come with its broadcast; give the round up at its deadline."""
        waiting = self._waiting
        if waiting is None:
            return
        a = waiting.assignment.facts
        # a difference this device could not use will not come again: ask at once
        due = waiting.due(time.monotonic(), 0.0 if a.sha256 == self.models.missed else self.model_wait_s)
        if due == "request":
            waiting.requested = True
            log.warning("round %d: model %s not received or rebuilt; asking the server", a.round, a.sha256[:12])
            request = ModelRequest(a.round, self.client_id, a.sha256, run_id=a.run_id)
            self.link.publish(self.topics.up(self.client_id), encode(request))
        elif due == "give_up":
            self._waiting = None
            detail = TimeoutError(f"model {a.sha256} not received in {a.deadline_s} s")
            self._fail(a.round, a.run_id, "model_unavailable", detail, a.deadline_s)

    def _model_for(self, spec: dict[str, Any], task: Task | None = None) -> FlatModel:
        """The model of ``spec`` (built once per spec), training with ``task``'s loss when given."""
        if self._model is None or spec != self._model_spec:
            self._model, self._model_spec = FlatModel(self.model_factory(spec)), dict(spec)
        if task is not None:
            self._model.loss_fn = task_loss(self._model.module, task)
        return self._model

    def _task_for(self, spec: Mapping[str, Any]) -> Task:
        """The task of ``spec``, built once; this device's targets are checked against it then."""
        key = json.dumps(spec, sort_keys=True)
        if key not in self._tasks:
            task = build_task(spec, self.allowed)
            problem = task.check_targets(self.dataset.y) if task.check_targets else None
            if problem:
                raise ValueError(f"this device's data does not fit the {task.name} task: {problem}")
            self._tasks[key] = task
        return self._tasks[key]

    def _evaluate(self, request: Evaluate) -> None:
        """Evaluate the global model on the held-out split and report loss, metrics and the device's time."""
        if self.holdout is None:
            detail = ValueError("this device holds out no data; start it with --holdout 0.1")
            self._fail(request.round, request.run_id, "no_holdout", detail, request.deadline_s)
            return
        try:
            task = self._task_for(request.task)
            model = self._model_for(request.model)
            wall0, cpu0 = time.perf_counter(), time.process_time()
            model.load(request.weights)
            result = evaluate(model.module, task, self.holdout)
            eval_s, cpu_s = time.perf_counter() - wall0, time.process_time() - cpu0
        except Exception as exc:  # a request this device cannot serve must not end the client
            self._fail(request.round, request.run_id, "evaluate", exc, request.deadline_s)
            return
        loss = result.pop("loss", float("nan"))
        report = Evaluation(
            request.round, self.client_id, len(self.holdout), loss, result, eval_s, cpu_s, run_id=request.run_id
        )
        self.link.publish(self.topics.up(self.client_id), encode(report))
        log.info("round %d: evaluated on %d held-out samples in %.3f s: loss %.4f %s",
                 request.round, len(self.holdout), eval_s, loss, result)  # fmt: skip

    def _state_path(self, name: str) -> Path | None:
        """Per job and algorithm, so that state from one federation never leaks into another."""
        return self.state_dir / self.topics.job / f"{name}.npz" if self.state_dir else None

    def _load_served(self) -> tuple[str, int, str]:
        path = self._state_path("served")
        try:
            saved = json.loads(path.with_suffix(".json").read_text()) if path else {}
            return str(saved["run"]), int(saved["round"]), str(saved["msg_id"])
        except (OSError, ValueError, KeyError, TypeError):
            return "", 0, ""

    def _mark_served(self, a: Assignment) -> None:
        facts = a.facts
        self.served = (facts.run_id, facts.round, a.msg_id)
        path = self._state_path("served")
        if path is not None:
            path = path.with_suffix(".json")
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps({"run": facts.run_id, "round": facts.round, "msg_id": a.msg_id}))
            os.replace(tmp, path)

    def _fail(self, round_: int, run_id: str, reason: str, exc: BaseException, deadline_s: float) -> None:
        """Tell the server this round cannot be served (so it stops waiting) and keep serving the next ones."""
        log.error("round %d: cannot serve the server's request (%s): %s", round_, reason, exc)
        failure = Failure(round_, self.client_id, reason, str(exc)[:2000], run_id=run_id)
        self._report(failure, encode(failure), deadline_s)

    def _algorithm_for(self, name: str) -> ClientAlgorithm:
        """One instance per algorithm, its state restored from ``state_dir`` after a restart."""
        if name not in self._algorithms:
            algorithm = self._algorithms[name] = client_algorithm(name)
            self._load_state(name, algorithm)
        return self._algorithms[name]

    def _load_state(self, name: str, holder: Stateful) -> None:
        path = self._state_path(name)
        if path is not None and path.exists():
            with np.load(path) as saved:
                holder.load_state_dict({k: saved[k] for k in saved.files})
            log.info("restored %s state from %s", name, path)

    def _save_state(self, name: str, holder: Stateful) -> None:
        """Written atomically after every round, so a restart never finds half a file."""
        path, state = self._state_path(name), holder.state_dict()
        if path is None or not state:
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp.npz")
        np.savez(tmp, **state)
        os.replace(tmp, path)

    def _start_secure(self, a: Assignment) -> bool:
        """Advertise this round's keys before training; False (reported) when this device cannot aggregate securely
        (the ``secure`` extra is not installed)."""
        if self._secure is None:
            try:
                from edge_client.secagg.client import SecureClient
            except ImportError as exc:
                self._fail(a.facts.round, a.facts.run_id, "secure_unavailable", exc, a.facts.deadline_s)
                return False
            publish = lambda msg: self.link.publish(self.topics.up(self.client_id), encode(msg))  # noqa: E731
            self._secure = SecureClient(self.client_id, publish, self._fail, self._served_securely)
        self._secure.start(a.facts)
        return True

    def _served_securely(self) -> None:
        self.rounds_done += 1

    def _serve(self, assignment: Assignment) -> None:
        """Train the assignment's plan with its round's facts beside it, and report the update (or the compute)."""
        plan, facts = assignment.plan, assignment.facts
        run, served, msg_id = self.served
        stale = facts.round < served - 1 or (facts.round == served and assignment.msg_id == msg_id)
        if facts.run_id == run and stale:  # e.g. replayed from the session after a restart
            log.warning("round %d: skipping a stale assignment (round %d of this run already served)",
                        facts.round, served)  # fmt: skip
            return
        if facts.sha256 not in self.models:  # its broadcast is late or was missed
            self._waiting = Waiting(assignment, time.monotonic())
            self._check_waiting()
            return
        self._waiting = None
        try:
            self.models.complete(assignment)
            model = self._model_for(facts.model, self._task_for(facts.task))
            algorithm = self._algorithm_for(facts.algorithm)
            weights = plan.weights
            if weights is None or model.size != weights.size:
                raise ValueError(
                    f"the server's model has {getattr(weights, 'size', 0)} parameters, this client's {model.size}"
                )
            algorithm.contract.check_plan(plan, model.size)
        except Exception as exc:  # a round this device cannot serve (its model, task or data) must not end the client
            self._fail(facts.round, facts.run_id, "assignment", exc, facts.deadline_s)
            return
        if facts.secure and facts.upload and not self._start_secure(assignment):
            return
        if self._sampler is None or self._sampler_key != (plan.batch_size, facts.seed):
            self._sampler = BatchSampler(len(self.dataset), plan.batch_size, facts.seed, self.client_id)
            self._sampler_key = (plan.batch_size, facts.seed)

        bytes_down = self.link.take_bytes_in(self.topics.down(self.client_id))
        bytes_down += self.link.take_bytes_in(self.topics.round_model)
        before = self.snapshot()
        try:
            result = self.train(model, weights, self.dataset, self._sampler, plan, algorithm, facts)
        except Exception as exc:  # e.g. out of memory or a model that cannot run on this data: report, keep serving
            log.exception("round %d: local training failed", facts.round)
            self._fail(facts.round, facts.run_id, "train_error", exc, facts.deadline_s)
            return
        after = self.snapshot()
        if not facts.upload:  # the server counts this compute in the fleet's, though no update follows
            self._save_state(facts.algorithm, algorithm)
            report = ComputeReport(facts.round, self.client_id, result.local_steps, result.compute_s,
                                   result.cpu_s, run_id=facts.run_id)  # fmt: skip
            self.link.publish(self.topics.up(self.client_id), encode(report))
            self._mark_served(assignment)
            log.info(
                "round %d: trained %d steps in %.3f s, kept locally (not selected to upload)",
                facts.round,
                result.local_steps,
                result.compute_s,
            )
            return

        metrics = {
            "threads": self.threads,
            "before": before,
            "after": after,
            "round": device.summarise(before, after),
            "bytes_down": bytes_down,
            "last_upload": self._last_upload,
        }
        if self._secure is not None and facts.secure:  # no update: the masked input goes in the stages
            scalars = {"local_steps": result.local_steps, "compute_s": result.compute_s, "cpu_s": result.cpu_s,
                       "train_loss": result.train_loss, "metrics": metrics}  # fmt: skip
            contract = algorithm.contract
            sent = self._secure.trained({"delta": result.delta, **result.arrays}, contract.summed,
                                        noise_std(plan.settings), scalars)  # fmt: skip
            committed = {k: v for k, v in sent.items() if contract.codec_rule(k) == "commit"}
            if committed:  # what the sum holds of it (clipped, quantised), as after a lossy codec
                algorithm.uploaded(committed)
            self._save_state(facts.algorithm, algorithm)
            self._mark_served(assignment)
            log.info("round %d: %d steps in %.3f s, loss %.4f; the masked input follows the secure stages",
                     facts.round, result.local_steps, result.compute_s, result.train_loss)  # fmt: skip
            return
        t0 = time.perf_counter()
        try:  # the upload codec; a commit array's value is adopted by the algorithm before its state is saved
            delta, arrays = self.uplink.encode(facts, algorithm, result.delta, result.arrays)
        except ValueError as exc:  # e.g. a diverged round's NaN, which no lossy codec carries
            delta, arrays, encode_error = result.delta, result.arrays, exc
        else:
            encode_error = None
        self._save_state(facts.algorithm, algorithm)
        self._save_state("uplink", self.uplink)
        if encode_error is not None:
            self._fail(facts.round, facts.run_id, "encode", encode_error, facts.deadline_s)
            return
        update = Update(
            round=facts.round,
            model_version=facts.model_version,
            client_id=self.client_id,
            num_samples=len(self.dataset),
            local_steps=result.local_steps,
            compute_s=result.compute_s,
            cpu_s=result.cpu_s,
            overhead_s=result.overhead_s,
            train_loss=result.train_loss,
            delta=delta,
            metrics=metrics,
            extras=result.extras,
            arrays=arrays,
            run_id=facts.run_id,
        )
        payload = encode(update)
        serialize_s = time.perf_counter() - t0
        t1 = time.perf_counter()
        sent = self._report(update, payload, facts.deadline_s)
        self.link.wait_published(timeout=max(facts.deadline_s, 30.0))
        # Serialising and uploading happen after the update is built, so they travel with the next one.
        self._last_upload = {"bytes": sent, "serialize_s": serialize_s, "upload_s": time.perf_counter() - t1}
        self._mark_served(assignment)
        self.rounds_done += 1
        log.info(
            "round %d: %d steps in %.3f s (cpu %.3f s), loss %.4f, serialise %.3f s, upload %d bytes in %.3f s",
            facts.round,
            result.local_steps,
            result.compute_s,
            result.cpu_s,
            result.train_loss,
            serialize_s,
            sent,
            self._last_upload["upload_s"],
        )
