"""The server side of compression: the codec each device is told (fixed or from its measured link), the int8 model
difference broadcast from the last model, admission of compressed arrays against the contract's rules, the
configuration keys, the byte figures of summary.json, and whole in-process runs with all of it switched on."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from edge_client.algorithms import CONTRACTS
from edge_client.algorithms.contract import codecs_markdown
from edge_client.wire import codecs as C
from edge_client.wire.messages import GlobalModel, Update, model_digest
from edge_client.wire.protocol import ProtocolError, decode, encode
from edgefl_testkit.algorithms import admit
from edgefl_testkit.basics import CHANCE
from edgefl_testkit.federation import make_config
from server.codec_policy import HEADER_BYTES, CodecPolicy, upload_bytes
from server.config import ConfigError, from_dict
from server.datasets import load_dataset
from server.downlink import Downlink
from server.experiments.inprocess import run_inprocess
from server.experiments.simulate import client_ids, prepare_shards
from server.report import summarize
from server.strategies.base import ServerContext, TrainSettings
from server.strategies.fedveca import FedVeca
from server.target import Target

LADDER = ["fp32", "fp16", "int8", "topk:0.1+int8", "topk:0.01+int8"]
D = 44_426


def policy(codec: str = "fp32", how: str = "link", budget: float = 1.0, algorithm: str = "fedavg") -> CodecPolicy:
    return CodecPolicy(codec, how, budget, LADDER, CONTRACTS[algorithm], D)


def uploaded(p: CodecPolicy, cid: str, *reports: tuple[Any, Any]) -> None:
    for sent, seconds in reports:
        p.observe(cid, {"last_upload": {"bytes": sent, "serialize_s": 0.01, "upload_s": seconds}})


# ------------------------------------------------------------------------------------------------------ link policy
def test_fixed_codec_for_every_device_whatever_its_link() -> None:
    p = policy("int8", how="fixed")
    uploaded(p, "slow", (1000, 100.0))
    assert p.codec_for("slow") == p.codec_for("new") == C.parse("int8")
    assert p.describe("slow") == {"codec": "int8"}


def test_link_policy_gives_the_least_lossy_codec_whose_upload_fits_the_budget() -> None:
    p = policy("topk:0.01+int8", budget=1.0)
    sizes = {str(spec): size for spec, size in p.ladder}
    assert sizes["fp32"] == HEADER_BYTES + 4 * D and sizes["int8"] == HEADER_BYTES + C.parse("int8").nbytes(D)
    assert p.codec_for("new") == C.parse("topk:0.01+int8")  # not measured yet: train.codec
    rates = {"lan": 10e6, "wifi": sizes["fp16"] * 1.01, "lte": sizes["int8"] * 1.5, "mesh": 30_000, "dead": 10.0}
    expected = {"lan": "fp32", "wifi": "fp16", "lte": "int8", "mesh": "topk:0.1+int8", "dead": "topk:0.01+int8"}
    for cid, rate in rates.items():
        uploaded(p, cid, (int(rate), 1.0))
        assert str(p.codec_for(cid)) == expected[cid], cid
    assert p.describe("lte") == {"codec": "int8", "upload_Bps": pytest.approx(rates["lte"], rel=1e-6)}
    assert p.describe("new") == {"codec": "topk:0.01+int8", "upload_Bps": None}


def test_link_rate_is_measured_over_the_last_uploads() -> None:
    p = policy(budget=1.0)
    uploaded(p, "d", *[(1000, 1.0)] * 5)  # 1 kB/s: nothing fits
    assert str(p.codec_for("d")) == "topk:0.01+int8"
    uploaded(p, "d", *[(10_000_000, 1.0)] * 5)  # the slow ones leave the window of five
    assert p.rate("d") == pytest.approx(10e6) and str(p.codec_for("d")) == "fp32"


@pytest.mark.parametrize(
    "report",
    [None, "fast", {}, {"bytes": True, "upload_s": 1.0}, {"bytes": -5, "upload_s": 1.0}, {"bytes": 10, "upload_s": 0},
     {"bytes": 10, "upload_s": float("nan")}, {"bytes": 10, "upload_s": float("inf")}, {"bytes": 10, "upload_s": "1"},
     {"bytes": 2**40, "upload_s": 1.0}, {"upload_s": 1.0}],
)  # fmt: skip
def test_implausible_upload_reports_are_ignored(report: Any) -> None:
    p = policy("int8")
    p.observe("d", {"last_upload": report})
    assert p.rate("d") is None and str(p.codec_for("d")) == "int8"


def test_upload_size_counts_each_array_with_its_rule() -> None:
    """FedVeca told int8: delta and G int8, grad (``half``) fp16."""
    int8 = C.parse("int8")
    expected = HEADER_BYTES + 2 * int8.nbytes(D) + 2 * D
    assert upload_bytes(int8, CONTRACTS["fedveca"], D) == expected
    assert upload_bytes(C.FP32, CONTRACTS["scaffold"], D) == HEADER_BYTES + 8 * D


# --------------------------------------------------------------------------------------------------------- downlink
def _model(weights: np.ndarray, round_: int = 1, **arrays: np.ndarray) -> GlobalModel:
    return GlobalModel(round_, round_ - 1, model_digest(weights, arrays), weights, arrays)


def test_the_round_model_goes_as_a_difference_from_the_last_one_named_by_the_model_it_rebuilds() -> None:
    rng = np.random.default_rng(0)
    w1 = rng.standard_normal(1000).astype(np.float32)
    c = np.full(1000, 0.5, np.float32)  # an array every client shares (SCAFFOLD's c): sent as it is
    down = Downlink("int8", seed=0)
    m1, sent1 = down.publish(_model(w1, 1, c=c))
    assert sent1 is m1 and sent1.diff_base == "" and np.array_equal(m1.weights, w1)  # nothing to differ from yet
    w2 = w1 + rng.standard_normal(1000).astype(np.float32) * np.float32(0.01)
    m2, sent2 = down.publish(_model(w2, 2, c=c))
    assert sent2.diff_base == m1.sha256 and sent2.sha256 == m2.sha256 and sent2.msg_id != m2.msg_id
    assert isinstance(sent2.weights, C.Encoded) and np.array_equal(sent2.arrays["c"], c)
    rebuilt = np.add(m1.weights, C.decode(sent2.weights), dtype=np.float32)  # what a device holding m1 rebuilds
    assert model_digest(rebuilt, {"c": c}) == m2.sha256 and np.array_equal(rebuilt, m2.weights)
    assert not np.array_equal(rebuilt, w2)  # lossy: the published model is not the server's
    wire = len(encode(sent2))
    assert wire < 0.3 * len(encode(m2)) + 4 * 1000  # the weights in int8, c in fp32
    again = down.publish(_model(w2, 3, c=c))  # the same start model again (a dropped round): the same pair
    assert again == (m2, sent2)


def test_what_a_difference_leaves_out_is_sent_with_the_next() -> None:
    """The published model tracks the server's: the error left after one difference shrinks with the next."""
    rng = np.random.default_rng(1)
    w1 = rng.standard_normal(5000).astype(np.float32)
    w2 = w1 + rng.standard_normal(5000).astype(np.float32)
    down = Downlink("int8:64", seed=0)
    down.publish(_model(w1))
    errors = []
    for r in range(3):
        # the same weights under a new digest each round (a shared array changes), so each round sends a difference
        published, _ = down.publish(_model(w2, r + 2, round_tag=np.full(1, r, np.float32)))
        errors.append(float(np.abs(published.weights - w2).max()))
    assert errors[1] < errors[0] / 20 and errors[2] < errors[1] / 20


def test_without_a_downlink_codec_the_model_goes_as_it_is() -> None:
    down = Downlink("fp32", seed=0)
    start = _model(np.ones(10, np.float32))
    assert down.publish(start) == (start, start)
    later = _model(np.full(10, 2.0, np.float32), 2)
    assert down.publish(later) == (later, later)


# -------------------------------------------------------------------------------------------------------- admission
def fedveca_update(codecs: dict[str, str]) -> Update:
    rng = np.random.default_rng(2)
    size = 64
    vectors = {name: rng.standard_normal(size).astype(np.float32) for name in ("delta", "grad", "G")}
    coded = {n: C.encode(v, C.parse(codecs.get(n, "fp32")), rng) for n, v in vectors.items()}
    update = Update(1, 0, "a", 10, 5, 0.0, 0.0, 0.0, coded.pop("delta"), extras={"beta": 1.0, "delta": 0.5})
    update.arrays = coded
    return decode(encode(update))  # type: ignore[return-value]


def fedveca() -> FedVeca:
    strategy = FedVeca(TrainSettings(5, 0.1, 8))
    strategy.setup(ServerContext({}, 64, {"a": 10}))
    return strategy


@pytest.mark.parametrize(
    "arrived, told, reason",
    [({"delta": "int8", "G": "int8", "grad": "fp16"}, "int8", None),  # what a device told int8 sends
     ({}, "int8", None),  # float32 is always accepted
     ({"grad": "int8"}, "int8", "codec"),  # grad is declared "half": never int8
     ({"delta": "int8"}, "fp32", "codec"),  # compressed though told fp32
     ({"delta": "int8:64"}, "int8", "codec"),  # another block size than told
     ({"G": "topk:0.5"}, "topk:0.1", "codec")],  # more top-k entries than told
)  # fmt: skip
def test_admission_judges_compressed_arrays_by_the_assignment_and_the_contract(
    arrived: dict[str, str], told: str, reason: str | None
) -> None:
    update = fedveca_update(arrived)
    if reason is None:
        admit(fedveca(), update, codec=told)
        return
    with pytest.raises(ProtocolError) as info:
        admit(fedveca(), update, codec=told)
    assert info.value.reason == reason


def test_docs_say_which_arrays_may_travel_compressed() -> None:
    text = (Path(__file__).resolve().parents[3] / "docs" / "algorithms.md").read_text()
    assert codecs_markdown(CONTRACTS.values()) in text
    assert "`scaffold` | `delta_c` | `commit`" in text and "`fedveca` | `grad` | `half`" in text


# ---------------------------------------------------------------------------------------------------- configuration
@pytest.mark.parametrize(
    "train, message",
    [({"codec": "int9"}, "train.codec: unknown codec 'int9'"),
     ({"codec": "topk:0.9"}, "train.codec: codec 'topk:0.9': F must be in (0, 0.5]"),
     ({"codec_policy": "fastest"}, "train.codec_policy must be 'fixed' or 'link'"),
     ({"codec_policy": "link"}, "train.upload_budget_s must be seconds > 0 when train.codec_policy = 'link'"),
     ({"codec_ladder": []}, "train.codec_ladder must be a non-empty list"),
     ({"codec_ladder": ["fp32", "int4"]}, "train.codec_ladder: unknown codec 'int4'"),
     ({"downlink_codec": "topk:0.1"}, "train.downlink_codec must be 'fp32' (the full model) or 'int8'"),
     ({"downlink_codec": "int8:0"}, "train.downlink_codec: codec 'int8:0': the int8 block size")],
)  # fmt: skip
def test_compression_settings_name_the_key_and_what_is_allowed(train: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        from_dict({"train": train})
    assert message in str(info.value)


def test_codec_flag_sets_the_codec_of_run_and_simulate() -> None:
    from server.cli import _config, build_parser

    for command in ("run", "simulate"):
        args = build_parser().parse_args([command, "--codec", "topk:0.01+int8"])
        assert _config(args).train.codec == "topk:0.01+int8"


# ---------------------------------------------------------------------------------------------------------- summary
def test_summary_counts_the_bytes_moved_until_the_target_and_the_codec_mix() -> None:
    def row(round_: int, accuracy: float, codec: str) -> dict[str, Any]:
        return {
            "round": round_, "accuracy": accuracy, "loss": 1.0, "elapsed_s": round_, "slowest_compute_s": 0.1,
            "clients": {"a": {"bytes_up": 100 * round_}, "b": {"bytes_up": 10}},  # b's only: a missed rounds
            "instructions": {"a": {"codec": codec, "bytes_down": 100}, "b": {"codec": "fp32", "bytes_down": 100},
                             "c": {"codec": codec, "bytes_down": 100}},  # c was told, never reported
            "bytes_out": 3000,  # the model broadcast once and the three assignments
        }  # fmt: skip

    rows = [row(1, 0.5, "int8"), row(2, 0.95, "int8"), row(3, 0.99, "topk:0.01")]
    s = summarize(rows, Target.accuracy(0.9))
    assert s["bytes_up"] == 100 + 200 + 300 + 3 * 10 and s["bytes_down"] == 9000
    assert s["bytes_to_target"] == (100 + 10 + 3000) + (200 + 10 + 3000)  # rounds 1 and 2, up and down
    assert s["codec_mix"] == {"fp32": 3, "int8": 4, "topk:0.01": 2}
    assert summarize(rows, Target.accuracy(0.999))["bytes_to_target"] is None


# ------------------------------------------------------------------------------------------- whole runs in-process
def run(tmp_path: Path, job: str, rounds: int = 3, **train: Any) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    config = make_config(tmp_path, job, 3, rounds, train=train)
    bundle = load_dataset("digits", seed=0)
    out = Path(config.run.out)
    shards, _ = prepare_shards(bundle, client_ids(3), "iid", 0, out / "shards")
    summary = run_inprocess(config, shards, bundle, out)
    return summary, [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_int8_up_and_down_trains_with_a_quarter_of_the_bytes(tmp_path: Path) -> None:
    base, base_rows = run(tmp_path, "plain")
    summary, rows = run(tmp_path, "int8", codec="int8", downlink_codec="int8")
    assert summary["final_accuracy"] > CHANCE + 0.5, (summary["final_accuracy"], base["final_accuracy"])
    assert summary["final_accuracy"] >= base["final_accuracy"] - 0.05
    assert summary["rejected"] == {} and all(r["failed"] == {} for r in rows)
    assert summary["codec_mix"] == {"int8": 9} and base["codec_mix"] == {"fp32": 9}
    assert [r["broadcast"] for r in rows] == ["model", "difference", "difference"]
    assert [r["broadcast"] for r in base_rows] == ["model"] * 3

    def broadcast(r: dict[str, Any]) -> int:  # the round's egress but its assignments: the model message
        return r["bytes_out"] - sum(told["bytes_down"] for told in r["instructions"].values())

    for r, b in zip(rows[1:], base_rows[1:], strict=True):
        assert broadcast(r) < 0.3 * broadcast(b)
        for cid in r["instructions"]:
            assert r["clients"][cid]["bytes_up"] < 0.3 * b["clients"][cid]["bytes_up"]
    assert summary["bytes_up"] + summary["bytes_down"] < 0.45 * (base["bytes_up"] + base["bytes_down"])
    assert (tmp_path / "int8" / "report.png").stat().st_size > 0


def test_link_policy_moves_measured_devices_off_the_start_codec(tmp_path: Path) -> None:
    """In-process uploads take microseconds: once measured (an update reports the previous upload, so from round 3
    on), every device fits the budget with fp32; before that it has the configured start codec."""
    summary, rows = run(tmp_path, "link", rounds=4, codec="topk:0.1+int8", codec_policy="link", upload_budget_s=5.0)
    told = [sorted({i["codec"] for i in r["instructions"].values()}) for r in rows]
    assert told == [["topk:0.1+int8"], ["topk:0.1+int8"], ["fp32"], ["fp32"]]
    assert all(i["upload_Bps"] is None for i in rows[1]["instructions"].values())
    assert all(i["upload_Bps"] > 0 for i in rows[2]["instructions"].values())
    assert summary["codec_mix"] == {"fp32": 6, "topk:0.1+int8": 6}
    for r in rows:  # each device uploaded with what it was told
        for cid, c in r["clients"].items():
            assert (c["bytes_up"] < 40_000) == (r["instructions"][cid]["codec"] != "fp32")
