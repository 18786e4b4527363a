"""Bounds that hold against one device (issue 23), each attack replayed with real messages through the real
orchestrator on the in-process bus, beside honest EdgeClients: one device cannot freeze the model with a huge
registered sample count, move it far with one large delta, decide a combined evaluation or the target with a huge
held-out split or an out-of-range metric, nor crash a round by saying hello again with another model.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from edge_client.learning.data import load_local_data, split_holdout
from edge_client.learning.tasks import TASKS
from edge_client.loop.runtime import EdgeClient
from edge_client.wire.messages import Assignment, Evaluate, Evaluation, Hello, Message, Update
from edge_client.wire.protocol import encode
from edge_client.wire.topics import Topics
from edgefl_testkit.fakes import FakeDevice, device_topics, zero_update
from server.admission import Admission, RoundState
from server.assembly import make_orchestrator, split_clients
from server.config import EvalSection, from_dict
from server.datasets import load_dataset
from server.experiments.inprocess import NO_DEADLINE_S, LocalBus, LocalLink
from server.experiments.simulate import client_ids, prepare_shards
from server.federated_eval import EvalRound, FederatedEvaluation
from server.strategies.base import TrainSettings
from server.strategies.fedavg import FedAvg
from server.weight_share import capped_counts

HOSTILE, JOB = "hostile", "bounds"
Answer = Callable[[Evaluate], list[Message]]


class Hostile(FakeDevice):
    """A FakeDevice that also declares a held-out split and answers evaluation requests with ``evaluate``."""

    def __init__(self, bus: LocalBus, topics: Topics, num_samples: int, respond: Any, *, eval_samples: int = 0,
                 evaluate: Answer | None = None) -> None:  # fmt: skip
        super().__init__(None, topics, HOSTILE, num_samples, respond)  # type: ignore[arg-type]
        self.eval_samples, self.evaluate = eval_samples, evaluate
        self.link = bus.connect(device_topics(topics, HOSTILE), self.hello)

    def hello(self) -> None:
        hello = Hello(self.client_id, self.num_samples, eval_samples=self.eval_samples)
        self.link.publish(self.topics.up(self.client_id), encode(hello))

    def handle(self, msg: Message) -> bool:
        if isinstance(msg, Evaluate):
            for answer in self.evaluate(msg) if self.evaluate else []:
                self.link.publish(self.topics.up(self.client_id), encode(answer))
            return True
        return super().handle(msg)


def run(
    tmp_path: Path, make_hostile: Callable[[LocalBus, Topics], Hostile], *, rounds: int = 3, **sections: dict[str, Any]
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Two honest devices (holding out ``eval.holdout`` of their shards) and the hostile one, on digits; the summary
    and the metrics rows. ``sections`` add to the base config's sections."""
    base: dict[str, dict[str, Any]] = {
        "run": {"rounds": rounds, "out": str(tmp_path), "job": JOB},
        "clients": {"count": 3, "round_deadline_s": NO_DEADLINE_S, "register_timeout_s": 30.0},
        "data": {"dataset": "digits"},
        "train": {"algorithm": "fedavg", "local_steps": 30, "batch_size": 16, "lr": 0.5},
        "model": {"name": "mlp", "in_features": 64, "num_classes": 10, "hidden": [16]},
    }
    for name, values in sections.items():
        base[name] = {**base.get(name, {}), **values}
    config = from_dict(base)
    bundle, root = split_clients(config, load_dataset("digits"))
    honest = client_ids(2)
    shards, _ = prepare_shards(bundle, honest, "iid", 0, tmp_path / "shards")
    bus, topics = LocalBus(), Topics(JOB)
    bus.add_client(make_hostile(bus, topics))  # first on the bus: its messages are judged before the honest ones
    for cid, shard in zip(honest, shards, strict=True):
        data, holdout = load_local_data(shard), None
        if config.eval.holdout:
            data, holdout = split_holdout(data, config.eval.holdout, 0, cid)
        bus.add_client(EdgeClient(cid, data, None, job=JOB, link_factory=bus.connect, holdout=holdout))
    link = LocalLink(bus, [topics.all_up], drives_clients=True)
    summary = make_orchestrator(config, bundle, tmp_path, link=link, root=root).run()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    return summary, rows


def answering(respond: Callable[[Assignment], list[Update | Hello]]) -> Callable[[Assignment], list[bytes]]:
    return lambda a: [encode(m) for m in respond(a)]


# ------------------------------------------------------------------------------------------------ aggregate weights
def test_capped_counts_hold_the_share_and_keep_moderate_fleets_exact() -> None:
    fleet = {"liar": 10**7, "a": 6000, "b": 6000, "c": 5000}
    for share in (0.5, 1 / 3):
        capped = capped_counts(fleet, share)
        assert max(capped.values()) <= share * sum(capped.values()) + 1e-9
        assert {k: capped[k] for k in "abc"} == {"a": 6000, "b": 6000, "c": 5000}  # below the cap: exact
    assert capped_counts({"a": 600, "b": 400, "c": 500}, 0.5) == {"a": 600, "b": 400, "c": 500}
    assert capped_counts({"a": 10**15, "b": 50}, 0.5) == {"a": 50, "b": 50}  # two devices: equal at most
    assert capped_counts({"a": 600, "b": 400, "c": 500, "z": 0}, 0.25) == {"a": 400, "b": 400, "c": 400, "z": 0}
    assert capped_counts(fleet, 1.0) == fleet


def test_a_capped_sample_weight_is_what_every_strategy_folds() -> None:
    """``Round.sample_weights`` replaces the update's count once, in ``Strategy.fold``: the kept report, and so the
    close's weights, carry it too."""
    strategy = FedAvg(TrainSettings(1, 0.1, 8), {"weighting": "samples"})
    rnd = strategy.begin(1, np.zeros(2, np.float32))
    rnd.sample_weights = {"liar": 10, "a": 10}
    for cid, n, delta in (("liar", 10**7, [0.0, 0.0]), ("a", 10, [1.0, 2.0])):
        u = Update(1, 0, cid, n, 1, 0.0, 0.0, 0.0, np.array(delta, np.float32))
        assert strategy.fold(rnd, u).num_samples == 10
    np.testing.assert_allclose(strategy.finish(rnd), [-0.5, -1.0])


@pytest.mark.parametrize("share", [0.5, pytest.param(1.0, marks=pytest.mark.slow)], ids=["capped", "uncapped"])
def test_a_huge_registered_sample_count_cannot_freeze_the_model(share: float, tmp_path: Path) -> None:
    """The issue's attack: samples weighting, 10^7 samples registered (under clients.max_samples), zero deltas. Without
    the cap (share 1: the attack replayed, marked slow) the model stays where it started; with the default cap the
    honest devices' half moves it."""
    liar = 10_000_000

    def hostile(bus: LocalBus, topics: Topics) -> Hostile:
        return Hostile(bus, topics, liar, answering(lambda a: [zero_update(a, HOSTILE, liar)]))

    summary, rows = run(
        tmp_path, hostile, rounds=2, clients={"max_weight_share": share}, algorithm={"fedavg": {"weighting": "samples"}}
    )
    first = rows[0]["clients"]
    honest = sum(first[c]["num_samples"] for c in client_ids(2))
    assert first[HOSTILE]["num_samples"] == liar
    if share < 1:
        assert first[HOSTILE]["weight_samples"] == honest  # half of the round's weight
        assert summary["final_accuracy"] > 0.5
    else:
        assert "weight_samples" not in first[HOSTILE]
        assert summary["final_accuracy"] < 0.3  # frozen near chance


# ------------------------------------------------------------------------------------------------ relative norms
def test_the_norm_bound_follows_the_previous_rounds_median_per_step() -> None:
    admission = Admission(FedAvg.contract, FedAvg.contract.resolve({}), 4, max_update_norm=1e4, max_norm_ratio=10)
    assert admission.norm_bound(5) == (1e4, "train.max_update_norm")  # round 1: only the fixed bound
    state = RoundState(1, 0, {"a", "b", "c", "z"}, step_norms={"a": 1.0, "b": 3.0, "c": 2.0, "z": 0.0})
    admission.close(state)
    assert admission.reference == 2.0  # zero deltas (z) say nothing of an honest step
    bound, setting = admission.norm_bound(5)
    assert bound == 100.0 and "train.max_norm_ratio" in setting
    admission.close(RoundState(2, 1, set()))  # nothing admitted: the reference stays
    assert admission.reference == 2.0
    assert admission.norm_bound(10**6)[0] == 1e4  # the fixed bound stays the outer limit


@pytest.mark.parametrize("ratio", [10.0, pytest.param(math.inf, marks=pytest.mark.slow)], ids=["bounded", "off"])
def test_one_large_delta_is_refused_relative_to_the_round(ratio: float, tmp_path: Path) -> None:
    """The issue's attack: uniform weighting, a delta of norm 9000 (under the fixed 1e4) in round 2. With
    train.max_norm_ratio it is refused as ``norm``; switched off (the attack replayed, marked slow), it is admitted and
    the model collapses."""

    def respond(a: Assignment) -> list[Update]:
        u = zero_update(a, HOSTILE, 100)
        if a.facts.round == 2:
            size = a.plan.weights.size  # type: ignore[union-attr]
            u.delta = np.full(size, 9000 / math.sqrt(size), np.float32)
        return [u]

    summary, rows = run(
        tmp_path, lambda bus, topics: Hostile(bus, topics, 100, answering(respond)), train={"max_norm_ratio": ratio}
    )
    second = rows[1]
    if math.isfinite(ratio):
        assert second["rejected"] == {"norm": 1} and HOSTILE not in second["clients"]
        assert second["failed"][HOSTILE] == "rejected: norm"
        assert summary["final_accuracy"] > 0.5
    else:
        assert HOSTILE in second["clients"] and not second["rejected"]
        assert summary["final_accuracy"] < 0.3


# ------------------------------------------------------------------------------------------------ device evaluation
def evaluation(request: Evaluate, samples: int, loss: float, **metrics: float) -> list[Message]:
    return [Evaluation(request.round, HOSTILE, samples, loss, dict(metrics), run_id=request.run_id)]


def test_a_huge_held_out_split_cannot_decide_the_target(tmp_path: Path) -> None:
    """The issue's attack: a device declaring a held-out split as large as allowed reports accuracy 1.0. Its weight
    is capped at half of the combined evaluation, so the run does not stop at the target in round 1."""
    held = 10_000_000

    def hostile(bus: LocalBus, topics: Topics) -> Hostile:
        return Hostile(bus, topics, 100, answering(lambda a: [zero_update(a, HOSTILE, 100)]), eval_samples=held,
                       evaluate=lambda e: evaluation(e, held, 0.0, accuracy=1.0))  # fmt: skip

    _, rows = run(
        tmp_path, hostile, rounds=2, run={"stop_at_target": True, "target_accuracy": 0.97},
        eval={"mode": "clients", "holdout": 0.2},
    )  # fmt: skip
    assert len(rows) == 2
    for row in rows:
        combined = row["client_eval"]
        honest = [combined["devices"][c]["accuracy"] for c in client_ids(2)]
        assert combined["devices"][HOSTILE]["weight_samples"] == sum(
            combined["devices"][c]["num_samples"] for c in client_ids(2)
        )
        assert combined["accuracy"] <= 0.5 + 0.5 * max(honest) + 1e-9


@pytest.mark.parametrize(
    ("hello", "report", "reason"),
    [
        ({"eval_samples": 10**15}, None, "num_samples"),  # refused at registration, above clients.max_samples
        ({"eval_samples": 50}, {"loss": 0.1, "accuracy": 1e6}, "metric_range"),
        ({"eval_samples": 50}, {"loss": -1e6, "accuracy": 0.5}, "metric_range"),
    ],
    ids=["huge_split", "accuracy_1e6", "negative_loss"],
)
def test_out_of_bound_evaluation_facts_are_refused(
    hello: dict, report: dict | None, reason: str, tmp_path: Path
) -> None:
    samples = hello["eval_samples"]

    def hostile(bus: LocalBus, topics: Topics) -> Hostile:
        answer = (lambda e: evaluation(e, samples, **report)) if report else None
        return Hostile(bus, topics, 100, answering(lambda a: [zero_update(a, HOSTILE, 100)]), eval_samples=samples,
                       evaluate=answer)  # fmt: skip

    fleet = {"min_clients": 2} if report is None else {}  # a device refused at registration never joins
    summary, rows = run(tmp_path, hostile, rounds=1, clients=fleet, eval={"mode": "clients", "holdout": 0.2})
    assert summary["rejected"].get(reason, 0) >= 1
    combined = rows[0]["client_eval"]
    assert HOSTILE not in combined["devices"] and 0.0 <= combined["accuracy"] <= 1.0


def test_a_negative_regression_loss_is_refused_before_the_rmse() -> None:
    """Regression's RMSE is sqrt of the combined loss: a report of loss -1e6 is refused, never combined."""
    fed = FederatedEvaluation(TASKS["regression"], EvalSection(), rounds=1, max_weight_share=0.5)
    state = fed.current = EvalRound(1, {"a", "liar"})
    fed.check("a", Evaluation(1, "a", 10, 4.0, {"mae": 1.5, "rmse": 2.0}, run_id="r"), 10, "r")
    with pytest.raises(Exception) as err:
        fed.check("liar", Evaluation(1, "liar", 10, -1e6, {"mae": 1.0}, run_id="r"), 10, "r")
    assert err.value.reason == "metric_range" and "outside [0, inf]" in str(err.value)  # type: ignore[attr-defined]
    assert fed.result(state)["rmse"] == pytest.approx(2.0)


# ------------------------------------------------------------------------------------------------ registry
OTHER_MODEL = {"digest": "0" * 64, "layout": [["w", [3], "float32"]]}  # a well-formed statement of another model


@pytest.mark.parametrize("update_first", [False, True], ids=["hello_then_update", "update_then_hello"])
def test_a_device_refused_mid_round_stays_known_until_the_round_closes(update_first: bool, tmp_path: Path) -> None:
    """A re-flashed device says hello with another model while selected: refused (``model``), kept refused and
    offline for the round (no KeyError in the round's bookkeeping), forgotten once it closed."""

    def respond(a: Assignment) -> list[Update | Hello]:
        if a.facts.round > 1:
            return [zero_update(a, HOSTILE, 100)]
        again = Hello(HOSTILE, 100, model=OTHER_MODEL)
        update = zero_update(a, HOSTILE, 100)
        return [update, again] if update_first else [again, update]

    summary, rows = run(tmp_path, lambda bus, topics: Hostile(bus, topics, 100, answering(respond)), rounds=2)
    first = rows[0]
    assert first["rejected"].get("model") == 1
    if update_first:
        assert HOSTILE in first["clients"] and HOSTILE not in first["failed"]
    else:
        assert first["failed"][HOSTILE] == "refused: model" and first["rejected"].get("out_of_round") == 1
        assert HOSTILE not in first["clients"]
    assert summary["rounds"] == 2 and HOSTILE not in rows[1]["clients"]  # forgotten after round 1
