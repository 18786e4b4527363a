"""Tasks, user factories, CSV device data, the held-out split, model fingerprints, the target and the admission of the
devices' evaluation reports (issue 13)."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest
import torch

from edge_client.algorithms import client_algorithm
from edge_client.learning.data import ArrayDataset, BatchSampler, load_local_data, split_holdout
from edge_client.learning.factories import AllowedCode, FactoryError, load_factory
from edge_client.learning.flat import FlatModel
from edge_client.learning.models import build_model, fingerprint, get_flat, layout_difference, parameter_layout
from edge_client.learning.tasks import TASKS, auc, build_task, combine_reports, evaluate, task_loss
from edge_client.loop.trainer import train_local
from edge_client.wire.messages import Evaluation, RoundFacts
from edge_client.wire.protocol import ProtocolError
from edgefl_testkit.federation import make_config
from edgefl_testkit.own import module_of
from server.config import ConfigError, EvalSection
from server.federated_eval import EvalRound, FederatedEvaluation
from server.strategies import STRATEGIES, ServerContext, TrainSettings, make_strategy
from server.target import Target, eval_mode, run_target


# ------------------------------------------------------------------------------------------------------ CSV data
def test_csv_loads_features_and_the_label_column(tmp_path: Path) -> None:
    path = tmp_path / "d.csv"
    path.write_text("a,target,b\n1,0.5,2\n3,1.5,4\n\n5,2.5,6\n")
    data = load_local_data(path, "target")
    np.testing.assert_array_equal(data.x, [[1, 2], [3, 4], [5, 6]])
    assert data.y.dtype == np.float32 and data.y.tolist() == [0.5, 1.5, 2.5]
    path.write_text("a,label\n0.1,0\n0.2,2\n")
    assert load_local_data(path, "label").y.dtype == np.int64  # class ids stay integers


def test_csv_errors_name_the_column_and_the_row(tmp_path: Path) -> None:
    path = tmp_path / "d.csv"
    path.write_text("a,target,b\n1,0.5,2\n3,oops,4\n")
    with pytest.raises(ValueError, match=r"no column 'label' for --label-column; the columns are a, target, b"):
        load_local_data(path, "label")
    with pytest.raises(ValueError, match=r"row 3, column 'target': 'oops' is not a number"):
        load_local_data(path, "target")
    path.write_text("a,target\n1,2\n3\n")
    with pytest.raises(ValueError, match="row 3 has 1 cells, the header 2"):
        load_local_data(path, "target")
    path.write_text("a,target\n1,nan\n")
    with pytest.raises(ValueError, match="row 2, column 'target': 'nan' is not a finite number"):
        load_local_data(path, "target")
    with pytest.raises(ValueError, match="needs --label-column"):
        load_local_data(path)


def test_holdout_is_seeded_disjoint_and_per_device() -> None:
    data = ArrayDataset(np.arange(100, dtype=np.float32)[:, None], np.arange(100))
    train, held = split_holdout(data, 0.1, 0, "pi-01")
    assert len(held) == 10 and len(train) == 90
    assert not set(held.y.tolist()) & set(train.y.tolist())
    again = split_holdout(data, 0.1, 0, "pi-01")[1]
    assert held.y.tolist() == again.y.tolist()  # the same samples on every start
    assert held.y.tolist() != split_holdout(data, 0.1, 0, "pi-02")[1].y.tolist()
    with pytest.raises(ValueError, match="leaves no validation"):
        split_holdout(ArrayDataset(np.zeros((3, 1)), np.zeros(3)), 0.1, 0, "pi-01")


# --------------------------------------------------------------------------------------------------------- tasks
def test_auc_matches_counting_pairs() -> None:
    rng = np.random.default_rng(3)
    scores, labels = np.round(rng.normal(size=60), 1), rng.integers(0, 2, 60)  # rounded: ties occur
    pairs = [(p, n) for p, n in itertools.product(scores[labels == 1], scores[labels == 0])]
    expected = sum(1.0 if p > n else 0.5 if p == n else 0.0 for p, n in pairs) / len(pairs)
    assert auc(scores, labels) == pytest.approx(expected)
    assert auc(scores, np.ones(60)) is None  # one class only: undefined, left out of the report


def test_regression_metrics_combine_by_samples_and_rmse_comes_from_the_pooled_mse() -> None:
    task = TASKS["regression"]
    outputs, targets = torch.tensor([[1.0], [2.0], [5.0]]), torch.tensor([1.0, 3.0, 3.0])
    assert task.metrics(outputs, targets) == pytest.approx({"mae": 1.0, "rmse": (5 / 3) ** 0.5})
    combined = combine_reports(task, [(1, {"loss": 4.0, "mae": 2.0, "rmse": 2.0}), (3, {"loss": 0.0, "mae": 0.0})])
    assert combined == pytest.approx({"loss": 1.0, "mae": 0.5, "rmse": 1.0})  # sqrt(1.0), not the mean of RMSEs


def test_a_users_model_and_task_from_their_module(user_code: Path) -> None:
    name = module_of(user_code)
    AllowedCode.of([user_code]).activate()
    model = build_model({"factory": f"{name}:build", "width": 6, "input_shape": [3]})
    assert [p[1] for p in parameter_layout(model)] == [[6, 3], [6], [1, 6], [1]]
    task = build_task({"factory": f"{name}:huber_task", "delta": 0.5})
    assert task.name == "huber" and task.metric_names == ("mae", "loss") and task.higher("mae") is False
    data = ArrayDataset(np.ones((4, 3), np.float32), np.array([0.5, 1.5, 2.5, 3.5], np.float32))
    assert set(evaluate(model, task, data)) == {"loss", "mae"}
    with pytest.raises(ValueError, match=r"does not take the \[model\] keys \['depth'\]"):
        build_model({"factory": f"{name}:build", "depth": 2})
    with pytest.raises(ValueError, match=r"returned Sequential, not an edge_client\.learning\.tasks\.Task"):
        build_task({"factory": f"{name}:build"})
    with pytest.raises(ValueError, match="name = 'ranking'"):
        build_task({"name": "ranking"})


def test_a_device_imports_only_code_it_was_allowed(user_code: Path, tmp_path: Path) -> None:
    name = module_of(user_code)
    other = tmp_path / "other"
    other.mkdir()
    with pytest.raises(FactoryError, match=rf"does not import '{name}'; start edge-client run with --model-path"):
        load_factory(f"{name}:build", "model.factory", AllowedCode.of([other]))
    with pytest.raises(FactoryError, match="does not import 'subprocess'"):  # installed, but not allowed
        load_factory("subprocess:run", "model.factory", AllowedCode.of([user_code]))
    assert load_factory(f"{name}:build", "model.factory", AllowedCode.of([user_code]))().__class__.__name__
    assert load_factory("json:dumps", "task.factory", AllowedCode(packages=("json",)))([1]) == "[1]"
    with pytest.raises(FactoryError, match=r'expected "package\.module:callable"'):
        load_factory("no-colon", "model.factory")


@pytest.mark.parametrize("task_name", ["regression", "binary"])
@pytest.mark.parametrize("algorithm", sorted(STRATEGIES))
def test_every_algorithms_client_half_trains_any_task(algorithm: str, task_name: str) -> None:
    """Each algorithm's first-round assignment, trained with the task's loss, lowers that loss on the device's data."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 3)).astype(np.float32)
    score = x @ np.array([1.0, -2.0, 0.5], np.float32)
    y = (score > 0).astype(np.int64) if task_name == "binary" else score
    data, task = ArrayDataset(x, y), TASKS[task_name]
    spec = {"name": "mlp", "in_features": 3, "num_classes": 1, "hidden": [8]}
    torch.manual_seed(0)
    module = build_model(spec)
    flat, w0 = FlatModel(module, task_loss(module, task)), get_flat(module)
    params = {"root_size": 16} if algorithm == "drag-br" else {}
    strategy = make_strategy(algorithm, TrainSettings(10, 0.05, 16, 1.0), params, 0, rounds=3)
    root = ArrayDataset(x[:16], y[:16]) if strategy.root_size(64) else None
    strategy.setup(ServerContext(spec, w0.size, {"c0": 64}, root, 0, task))
    selected = strategy.select(1, ["c0"])
    plan = strategy.assign(1, "c0")
    facts = RoundFacts(round=1, upload="c0" in selected)
    client = client_algorithm(algorithm)
    client.contract.check_plan(plan, flat.size)
    result = train_local(flat, w0, data, BatchSampler(64, plan.batch_size, 0, "c0"), plan, client, facts)
    assert np.isfinite(result.delta).all() and np.abs(result.delta).sum() > 0
    flat.load(w0)
    before = evaluate(module, task, data)["loss"]
    flat.load(w0 - result.delta)
    assert evaluate(module, task, data)["loss"] < before


# ------------------------------------------------------------------------------------------------- fingerprints
def test_a_layout_difference_names_the_parameter() -> None:
    server = parameter_layout(build_model({"name": "mlp", "in_features": 8, "num_classes": 3, "hidden": [16]}))
    device = parameter_layout(build_model({"name": "mlp", "in_features": 8, "num_classes": 3, "hidden": [4]}))
    assert fingerprint(server) != fingerprint(device)
    assert fingerprint(server) == fingerprint([list(p) for p in server])
    assert layout_difference(server, device) == (
        "parameter #0 is 'net.1.weight' [4, 8] float32 on the device, 'net.1.weight' [16, 8] float32 on the server"
    )
    assert "missing on the device" in layout_difference(server, server[:2])
    assert "no parameter layout" in layout_difference(server, "garbage")


# --------------------------------------------------------------------------------------------------------- target
def test_the_target_in_either_direction(tmp_path: Path) -> None:
    config = make_config(tmp_path, "t", 2, 3)
    config.run.target_metric, config.run.target = "rmse", 0.5
    target = run_target(config, TASKS["regression"], "clients")
    assert (target.higher_is_better, target.source) == (False, "clients")
    row = {"client_eval": {"rmse": 0.4}, "rmse": 9.0}
    assert target.of(row) == 0.4 and target.reached(0.4) and not target.reached(0.6)
    assert target.better(0.4, 0.6) and not target.better(None, 0.6)
    config.run.target_metric = "auc"
    with pytest.raises(ConfigError, match="'auc' is not a metric of the regression task; choose one of rmse"):
        run_target(config, TASKS["regression"], "server")
    classification = make_config(tmp_path, "c", 2, 3)
    assert run_target(classification, TASKS["classification"], "server") == Target.accuracy(0.5)
    with pytest.raises(ConfigError, match=r'eval\.mode = "both" needs a test set on the server'):
        classification.eval.mode = "both"
        eval_mode(classification, server_has_test_set=False)


# -------------------------------------------------------------------------------------- the devices' evaluations
def test_evaluation_reports_are_admitted_only_as_asked() -> None:
    fed = FederatedEvaluation(TASKS["regression"], EvalSection(every=3), rounds=7, max_weight_share=0.5)
    assert [r for r in range(1, 8) if fed.due(r)] == [3, 6, 7]
    state = EvalRound(3, {"a", "b"})
    fed.current = state

    def report(cid: str = "a", **changes: object) -> Evaluation:
        fields = {"round": 3, "client_id": cid, "num_samples": 10, "loss": 1.0, "metrics": {"mae": 0.5},
                  "run_id": "r1", **changes}  # fmt: skip
        return Evaluation(**fields)  # type: ignore[arg-type]

    refused = [
        ("out_of_round", "a", report(round=2)),
        ("out_of_round", "a", report(run_id="other")),
        ("out_of_round", "c", report("c")),  # not asked
        ("num_samples", "a", report(num_samples=10_000)),  # not the held-out size it registered
        ("non_finite", "a", report(loss=float("nan"))),
        ("non_finite", "a", report(metrics={"mae": float("inf")})),
        ("invalid_field", "a", report(metrics={"accuracy": 1.0})),  # not a regression metric
        ("invalid_field", "b", report("a")),  # b's topic, a's id
    ]
    for reason, sender, r in refused:
        with pytest.raises(ProtocolError) as err:
            fed.check(sender, r, 10, "r1")
        assert err.value.reason == reason, (reason, r)
    fed.check("a", report(), 10, "r1")
    with pytest.raises(ProtocolError, match="second evaluation"):
        fed.check("a", report(), 10, "r1")
    assert fed.failed("b", 3, "no_holdout")
    result = fed.result(state)
    assert result is not None and result["missing"] == ["b"] and result["num_samples"] == 10
    assert result["rmse"] == pytest.approx(1.0) and result["devices"]["a"]["mae"] == 0.5
