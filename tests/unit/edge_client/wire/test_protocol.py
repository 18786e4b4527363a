"""Wire protocol: round trips, zero-copy decoding and every rejection path (fuzzing is in test_fuzz.py)."""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edge_client.wire import codecs
from edge_client.wire import messages as M
from edge_client.wire import protocol as P
from edge_client.wire.plan import Plan

V = P.PROTOCOL_VERSION


def _assignment(settings: dict[str, Any] | None = None, arrays: dict[str, np.ndarray] | None = None) -> M.Assignment:
    plan = Plan(
        steps=5,
        lr=0.05,
        batch_size=32,
        settings={"beta": 0.9, "flag": True, "mode": "x", "alpha_i": 0.5} if settings is None else settings,
        momentum=0.5,
        weight_decay=5e-4,
    )
    facts = M.RoundFacts(
        round=3,
        model_version=2,
        sha256="ab" * 32,
        deadline_s=30.0,
        upload=False,
        run_id="3f2a9c1b7d4e",
        algorithm="taco",
        model={"name": "cnn", "in_channels": 1, "num_classes": 10, "image_size": 28},
        seed=7,
    )
    if arrays is None:
        arrays = {"c": np.full(10, 0.25, np.float32), "c_i": np.ones(10, np.float32)}
    return M.Assignment(plan, facts, arrays=arrays, global_arrays=["c_global"])


def _update(**kw: Any) -> M.Update:
    args: dict[str, Any] = dict(
        round=3,
        model_version=2,
        client_id="pi-01",
        num_samples=600,
        local_steps=5,
        compute_s=1.25,
        cpu_s=2.5,
        train_loss=0.7,
        delta=np.linspace(-1, 1, 12, dtype=np.float32),
        metrics={"cpu_temp_c": 51.2, "serialise_s": 0.01},
        extras={"beta": 0.3},
        arrays={"dc": np.full(12, -2.0, np.float32)},
        run_id="3f2a9c1b7d4e",
    )
    args.update(kw)
    return M.Update(**args)


def _global_model(**kw: Any) -> M.GlobalModel:
    weights = np.linspace(-1, 1, 10, dtype=np.float32)
    arrays = kw.pop("arrays", {"c_global": np.full(10, 0.5, np.float32)})
    return M.GlobalModel(3, 2, M.model_digest(weights, arrays), weights, arrays, run_id="3f2a9c1b7d4e", **kw)


def _edit(payload: bytes | bytearray, fn: Callable[[dict[str, Any]], Any], tail: bytes | None = None) -> bytes:
    """Re-pack a valid frame's header after ``fn`` edits it (bypasses encode's own validation)."""
    header, off = P.read_header(payload)
    header = copy.deepcopy(header)
    fn(header)
    return msgpack.packb(header, use_bin_type=True) + (bytes(payload[off:]) if tail is None else tail)


MESSAGES = [
    _assignment(),
    _assignment(arrays={}, settings={}),
    _update(),
    _update(arrays={}, metrics={}, extras={}),
    M.Hello("pi-01", 600, {"hostname": "pi", "machine": "aarch64", "cpu_count": 4}),
    M.Presence("server", True, role="server", reason="start"),
    M.Presence("pi-01", False, reason="lost"),
    M.Stop("done"),
    M.Stop("done", run_id="3f2a9c1b7d4e"),
    M.Failure(3, "pi-01", "train_error", "out of memory", run_id="3f2a9c1b7d4e"),
    _global_model(),
    _global_model(arrays={}),
    M.ModelRequest(3, "pi-01", "cd" * 32, run_id="3f2a9c1b7d4e"),
    M.ComputeReport(3, "pi-01", 50, 1.25, 1.1, run_id="3f2a9c1b7d4e"),
]


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: m.TYPE)
def test_round_trip(msg: M.Message) -> None:
    payload = bytes(P.encode(msg))
    out = P.decode(payload)
    assert type(out) is type(msg)
    for name, value in vars(msg).items():
        got = getattr(out, name)
        if isinstance(value, np.ndarray):
            assert got.dtype == np.dtype("<f4") and np.array_equal(got, value)
            assert np.shares_memory(got, np.frombuffer(payload, np.uint8))  # a view, not a copy
        elif name == "arrays":
            assert got.keys() == value.keys()
            for k, v in value.items():
                assert got[k].dtype == np.dtype("<f4") and np.array_equal(got[k], v)
                assert np.shares_memory(got[k], np.frombuffer(payload, np.uint8))
        else:
            assert got == value, name


def test_encode_converts_and_accepts_numpy_scalars() -> None:
    msg = _update(delta=np.arange(4, dtype=np.float64), round=np.int64(4), metrics={"t": np.float32(1.5)})
    out = P.decode(P.encode(msg))
    assert out.round == 4 and type(out.round) is int and out.metrics == {"t": 1.5}
    assert out.delta.dtype == np.dtype("<f4") and np.array_equal(out.delta, [0, 1, 2, 3])
    big_endian = np.arange(3, dtype=">f4")
    assert np.array_equal(P.decode(P.encode(_update(delta=big_endian))).delta, [0, 1, 2])


def test_decode_accepts_memoryview_and_bytearray() -> None:
    payload = P.encode(_update())
    assert isinstance(payload, bytearray)
    assert np.array_equal(P.decode(memoryview(payload)).delta, _update().delta)


def test_empty_vector_and_nd_extra_array() -> None:
    msg = _update(delta=np.zeros(0, np.float32), arrays={"m": np.ones((2, 3), np.float32)})
    out = P.decode(P.encode(msg))
    assert out.delta.shape == (0,) and out.arrays["m"].shape == (2, 3)


def test_read_header_offset() -> None:
    payload = P.encode(_update())
    header, off = P.read_header(payload)
    assert header["t"] == "update" and header["v"] == P.PROTOCOL_VERSION and len(payload) - off == 4 * (12 + 12)
    assert [a[0] for a in header["a"]] == ["delta", "x:dc"]


def test_defaults_may_be_omitted_on_the_wire() -> None:
    payload = _edit(P.encode(M.Presence("pi-01", True)), lambda h: [h["f"].pop("role"), h["f"].pop("reason")])
    out = P.decode(payload)
    assert out.role == "client" and out.reason == ""


# ---------------------------------------------------------------------------------------------------- rejections
def _reject(payload: bytes | bytearray, exc: type[P.ProtocolError], *words: str, **kw: Any) -> None:
    with pytest.raises(exc) as info:
        P.decode(payload, **kw)
    assert type(info.value) is exc
    for w in words:
        assert w in str(info.value), (w, str(info.value))


GOOD = bytes(P.encode(_update()))


@pytest.mark.parametrize(
    ("payload", "words"),
    [
        (b"\xc1\xc1\xc1 not msgpack", ("msgpack",)),
        (b"", ("truncated",)),
        (GOOD[:20], ("truncated",)),
        (msgpack.packb([1, "update", "x"]), ("map", "list")),
        (msgpack.packb({"v": V, "t": "stop", "id": "a" * 32, "f": {"reason": "x"}, "zz": 1}), ("zz",)),
        (msgpack.packb({"t": "stop", "id": "a" * 32, "f": {}}), ("'v'",)),
        (msgpack.packb({"v": V, "t": "stop", "id": "a" * 32}), ("'f'",)),
        (msgpack.packb({"v": V, "t": "stop", "id": "a" * 32, "f": []}), ("'f'",)),
        (msgpack.packb({"v": V, "t": "stop", "id": "a" * 32, "f": {"reason": "x"}, "a": {}}), ("'a'",)),
        (msgpack.packb({"v": V, "t": "stop", "id": "a" * 32, "f": {"reason": "x"}, "a": [["x"]]}), ("array",)),
        (msgpack.packb({"v": V, "t": "stop", "f": {1: 2}}), ("msgpack",)),  # non-str map key
        (msgpack.packb({"v": V, "t": "stop", "f": {"reason": msgpack.ExtType(1, b"x")}}), ("msgpack",)),
        (msgpack.packb({"v": V, "t": "stop", "f": {"reason": "x" * (P.MAX_HEADER_BYTES + 10)}}), ("65536",)),
    ],
)
def test_malformed(payload: bytes, words: tuple[str, ...]) -> None:
    _reject(payload, P.MalformedMessage, *words)


def test_version_and_type() -> None:
    expected = f"expected {P.PROTOCOL_VERSION}"
    _reject(_edit(GOOD, lambda h: h.update(v=1)), P.UnsupportedVersion, "version", expected, "got 1")
    _reject(_edit(GOOD, lambda h: h.update(v=True)), P.UnsupportedVersion, "True")
    _reject(_edit(GOOD, lambda h: h.update(t="gossip")), P.UnknownMessageType, "gossip")
    _reject(_edit(GOOD, lambda h: h.update(t=["update"])), P.UnknownMessageType, "['update']")
    with pytest.raises(P.UnknownMessageType):
        P.encode(object())  # type: ignore[arg-type]


def test_message_id() -> None:
    _reject(_edit(GOOD, lambda h: h.update(id="bad id/")), P.InvalidField, "id", "bad id/")
    _reject(_edit(GOOD, lambda h: h.pop("id")), P.MalformedMessage, "'id'")
    with pytest.raises(P.InvalidField, match="msg_id"):
        P.encode(M.Stop("x", msg_id=""))


def test_missing_fields() -> None:
    _reject(_edit(GOOD, lambda h: h["f"].pop("round")), P.MissingField, "update: missing field 'round'")
    _reject(_edit(GOOD, lambda h: h.update(a=[]), tail=b""), P.MissingField, "update: missing field 'delta'")
    model = P.encode(_global_model(arrays={}))
    _reject(_edit(model, lambda h: h.update(a=[]), tail=b""), P.MissingField, "global_model: missing field 'weights'")
    _reject(_edit(P.encode(_assignment()), lambda h: h["f"]["facts"].pop("sha256")), P.MissingField, "'facts.sha256'")
    _reject(_edit(P.encode(_assignment()), lambda h: h["f"].pop("plan")), P.MissingField, "'plan'")


@pytest.mark.parametrize(
    ("field", "value", "expected"),
    [
        ("round", True, "an int"),  # bool is not an int
        ("round", 1.0, "an int"),
        ("round", -1, ">= 0"),
        ("local_steps", -1, ">= 0"),
        ("num_samples", "600", "an int"),
        ("compute_s", -0.5, ">= 0"),
        ("compute_s", float("nan"), "finite"),
        ("cpu_s", float("inf"), "finite"),
        ("cpu_s", None, "float"),
        ("train_loss", "x", "float"),
        ("client_id", "a/b", "client_id"),
        ("client_id", "", "client_id"),
        ("client_id", 5, "str"),
        ("metrics", [1, 2], "map"),
        ("extras", None, "map"),
    ],
)
def test_invalid_update_fields(field: str, value: Any, expected: str) -> None:
    _reject(_edit(GOOD, lambda h: h["f"].update({field: value})), P.InvalidField, field, expected)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("plan.steps", 0),
        ("plan.batch_size", 0),
        ("plan.lr", 0.0),
        ("plan.lr", float("inf")),
        ("plan.settings", [1]),
        ("plan.momentum", -0.5),
        ("facts.deadline_s", -1),
        ("facts.upload", 1),
        ("facts.seed", False),
        ("facts.model", "cnn"),
        ("facts.algorithm", None),
        ("facts.sha256", "ab" * 31),
        ("facts.sha256", "AB" * 32),
        ("facts.run", "a b"),
        ("plan", 5),
        ("facts", None),
        ("globals", "c_global"),
        ("globals", ["c", "c"]),
        ("globals", [""]),
        ("globals", ["x"] * 33),
    ],
)
def test_invalid_assignment_fields(field: str, value: Any) -> None:
    """Every field of the plan and of the round's facts is checked by its own declaration; TACO's alpha_i is a
    per-round value of its contract, checked there (tests/unit/algorithms/test_algo_taco.py)."""
    record, _, key = field.rpartition(".")

    def edit(h: dict[str, Any]) -> None:
        (h["f"][record] if record else h["f"])[key] = value

    _reject(_edit(P.encode(_assignment()), edit), P.InvalidField, repr(field))


def test_an_unknown_field_of_a_record_is_refused() -> None:
    payload = _edit(P.encode(_assignment()), lambda h: h["f"]["plan"].update(alpha=0.5))
    _reject(payload, P.InvalidField, "unknown field 'plan.alpha'")


def test_int_accepted_for_float() -> None:
    out = P.decode(_edit(P.encode(_assignment()), lambda h: h["f"]["plan"].update(lr=1)))
    assert out.plan.lr == 1 and out.plan.settings["alpha_i"] == 0.5


def test_unknown_field() -> None:
    _reject(_edit(GOOD, lambda h: h["f"].update(sneaky=1)), P.InvalidField, "unknown field 'sneaky'")


def test_presence_role() -> None:
    _reject(P.encode(M.Presence("a", True)).replace(b"client", b"master"), P.InvalidField, "role", "master")


def test_shapes() -> None:
    _reject(GOOD[:-4], P.ShapeMismatch, "expected 96 bytes", "got 92")
    _reject(GOOD + b"\0" * 4, P.ShapeMismatch, "got 100")
    _reject(_edit(GOOD, lambda h: h["a"][0].__setitem__(2, [3, 4])), P.ShapeMismatch, "'delta'", "1-D")
    _reject(_edit(GOOD, lambda h: h["a"][0].__setitem__(2, [-12])), P.ShapeMismatch, "'delta'", "shape")
    _reject(_edit(GOOD, lambda h: h["a"][0].__setitem__(2, 12)), P.ShapeMismatch, "'delta'", "shape")
    _reject(_edit(GOOD, lambda h: h["a"][1].__setitem__(2, [1] * 33)), P.ShapeMismatch, "'x:dc'", "shape")
    _reject(_edit(GOOD, lambda h: h["a"][0].__setitem__(1, "<f8")), P.InvalidField, "'delta'", "'<f4'", "'<f8'")
    _reject(_edit(GOOD, lambda h: h["a"][1].__setitem__(0, "delta")), P.InvalidField, "repeated")
    _reject(_edit(GOOD, lambda h: h["a"][1].__setitem__(0, "weights")), P.InvalidField, "weights")
    _reject(_edit(P.encode(M.Stop("x")), lambda h: h.update(a=[["x:a", "<f4", [0]]])), P.InvalidField, "x:a")
    # the model never travels inside an assignment: only its own arrays ("x:...") may
    a = P.encode(_assignment())
    _reject(_edit(a, lambda h: h["a"][0].__setitem__(0, "weights")), P.InvalidField, "assignment", "weights")


def test_model_digest_names_weights_and_every_shared_array() -> None:
    """Two models with any byte or array name different never share a digest; equal content always does."""
    w = np.arange(6, dtype=np.float32)
    c = np.ones(6, np.float32)
    base = M.model_digest(w, {"c": c})
    assert base == M.model_digest(w.copy(), {"c": c.copy()}) == M.model_digest(w.astype(">f4"), {"c": c})
    w2 = w.copy()
    w2[3] = np.nextafter(w2[3], np.float32(10))
    others = [M.model_digest(w2, {"c": c}), M.model_digest(w, {}), M.model_digest(w, {"d": c}),
              M.model_digest(w, {"c": c, "d": c}), M.model_digest(np.concatenate([w, c]), {})]  # fmt: skip
    assert len({base, *others}) == 1 + len(others)


def test_encode_rejects_bad_arrays() -> None:
    with pytest.raises(P.InvalidField, match="1-D"):
        P.encode(_update(delta=np.zeros((2, 2), np.float32)))
    with pytest.raises(P.InvalidField, match="float"):
        P.encode(_update(delta=np.arange(3)))
    with pytest.raises(P.InvalidField, match="float"):
        P.encode(_update(arrays={"c": [1.0, 2.0]}))
    with pytest.raises(P.InvalidField, match="arrays"):
        P.encode(_update(arrays={"": np.zeros(1, np.float32)}))
    with pytest.raises(P.InvalidField, match="local_steps"):
        P.encode(_update(local_steps=-1))
    with pytest.raises(P.InvalidField, match="serialised"):  # a server's map is checked where it is used
        P.encode(M.Presence("server", True, model={"x": object()}))


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite(bad: float) -> None:
    delta = np.ones(12, np.float32)
    delta[[2, 5]] = bad
    _reject(P.encode(_update(delta=delta)), P.NonFiniteValues, "'delta'", "2 non-finite")
    extra = np.zeros(12, np.float32)
    extra[0] = bad
    _reject(P.encode(_update(arrays={"dc": extra})), P.NonFiniteValues, "'x:dc'", "1 non-finite")


def test_a_refused_frame_says_what_it_claimed_to_be() -> None:
    """Once the header was read, the error names the message type and round: a refused update tells the server not
    to wait for that device's update of the round."""
    delta = np.full(12, np.nan, np.float32)
    with pytest.raises(P.NonFiniteValues) as info:
        P.decode(P.encode(_update(delta=delta)))
    assert (info.value.of_type, info.value.of_round) == ("update", 3)
    with pytest.raises(P.MalformedMessage) as bad:  # no header: nothing is claimed
        P.decode(b"\x00not msgpack")
    assert (bad.value.of_type, bad.value.of_round) == (None, None)


def test_nan_train_loss_is_reported_not_rejected() -> None:
    assert np.isnan(P.decode(P.encode(_update(train_loss=float("nan")))).train_loss)


def test_too_large() -> None:
    _reject(GOOD, P.MessageTooLarge, f"got {len(GOOD)}", max_bytes=len(GOOD) - 1)
    assert P.decode(GOOD, max_bytes=len(GOOD)).client_id == "pi-01"


def test_reasons_are_distinct() -> None:
    classes = [c for c in vars(P).values() if isinstance(c, type) and issubclass(c, P.ProtocolError)]
    assert len({c.reason for c in classes}) == len(classes) == 14
    assert all(issubclass(c, ValueError) for c in classes)


def test_a_round_model_may_carry_its_weights_as_a_compressed_difference_and_nothing_else_compressed() -> None:
    """The int8 downlink (server.downlink): a GlobalModel's weights may travel coded, decoded on arrival; its shared
    arrays and an assignment's arrays may not (only an update's arrays are coded otherwise)."""
    rng = np.random.default_rng(0)
    diff = codecs.encode(rng.standard_normal(600).astype(np.float32), codecs.parse("int8"), rng)
    c = np.full(600, 0.5, np.float32)
    message = M.GlobalModel(3, 2, "ab" * 32, diff, {"c": c}, run_id="3f2a9c1b7d4e", diff_base="cd" * 32)
    got = P.decode(P.encode(message))
    assert isinstance(got, M.GlobalModel) and got.diff_base == "cd" * 32
    assert np.array_equal(got.weights, codecs.decode(diff)) and np.array_equal(got.arrays["c"], c)
    coded_c = M.GlobalModel(3, 2, "ab" * 32, c, {"c": diff}, run_id="3f2a9c1b7d4e")
    _reject(P.encode(coded_c), P.InvalidField, "'x:c'", "dtype")
    assignment = _assignment(arrays={"c": diff})
    _reject(P.encode(assignment), P.InvalidField, "'x:c'", "dtype")
    _reject(_edit(P.encode(message), lambda h: h["f"].update(diff_base="xyz")), P.InvalidField, "'diff_base'")


# ------------------------------------------------------------------------------------ the declared schema, derived
def test_every_wire_field_is_declared_once_and_the_type_table_is_derived() -> None:
    """The framing's tables come from the dataclasses: every header key is one declared attribute, the required keys
    are the attributes without a default (every key of an assignment), and array kinds follow the declarations."""
    from dataclasses import fields

    from edge_client.wire.schema import ARRAY, WIRE

    assert set(M.SCHEMAS) == {c.TYPE for c in (*M.FROM_DEVICES, M.Assignment, M.Stop, M.Ack, M.ModelFile)} | {
        "global_model", "evaluate", "refusal", "secagg_roster", "secagg_relay", "secagg_unmask"}  # fmt: skip
    for t, schema in M.SCHEMAS.items():
        declared = {f.name for f in fields(schema.cls) if WIRE in f.metadata}
        assert sorted(attr for attr, _ in schema.fields.values()) == sorted(declared), t
        no_default = {f.name for f in fields(schema.cls) if f.name in declared and f.default is f.default_factory}
        required = {attr for key, (attr, _) in schema.fields.items() if key in schema.required}
        assert required == (declared if t == "assignment" else no_default), t
        assert set(schema.arrays) == {f.name for f in fields(schema.cls) if ARRAY in f.metadata}, t
    assert [t for t, s in M.SCHEMAS.items() if s.blob] == ["model", "masked_input", "chunk"]
    assert {t: s.vector for t, s in M.SCHEMAS.items() if s.vector} == {
        "update": "delta", "global_model": "weights", "evaluate": "weights"}  # fmt: skip
    assert sorted(t for t, s in M.SCHEMAS.items() if s.named) == ["assignment", "global_model", "update"]


def test_a_declared_field_is_checked_on_the_wire() -> None:
    """What a declaration says is what decode enforces: a presence's reason (<= 200 chars) and a hello's model."""
    presence = P.encode(M.Presence("pi-01", False, reason="lost"))
    _reject(_edit(presence, lambda h: h["f"].update(reason="x" * 201)), P.InvalidField, "'reason'", "200")
    hello = P.encode(M.Hello("pi-01", 10, model={"digest": "ab" * 32, "layout": [["w", [2, 3], "float32"]]}))
    assert P.decode(hello).model["layout"] == [["w", [2, 3], "float32"]]
    for bad in ({"digest": "xyz"}, {"layout": [["w", [-1], "float32"]]}, {"layout": [[b"w", [1], "f"]]}, {"z": 1}):
        _reject(_edit(hello, lambda h, bad=bad: h["f"].update(model=bad)), P.InvalidField, "'model'")


# ------------------------------------------------------------------------------------------------- free-form maps
HOSTILE_ENTRIES: dict[str, tuple[Any, str]] = {  # key -> (value, reason it is dropped with)
    "note": (b"\x00", "dropped_type"),
    "nan": (float("nan"), "dropped_non_finite"),
    "inf": (float("-inf"), "dropped_non_finite"),
    "huge": (2**63, "dropped_range"),
    "long": ("x" * 129, "dropped_range"),
    "deep": ({"a": {"b": 1}}, "dropped_type"),  # the inner map's own entry "a" is a map: dropped, the rest kept
    "maps_in_list": ([{"a": 1}], "dropped_type"),
    "long_list": (list(range(33)), "dropped_range"),
    "bad key!": (1, "dropped_key"),
}


def _raw_update(metrics: Any) -> bytes:
    """An honest update frame whose metrics map is ``metrics`` as a hostile device would pack it (no encode checks)."""
    return _edit(P.encode(_update(metrics={})), lambda h: h["f"].update(metrics=metrics))


def test_an_update_keeps_its_honest_metrics_and_drops_each_unsafe_entry_with_its_reason() -> None:
    honest = {"threads": 4, "before": {"time": 1.5, "temperature_c": None, "throttled_flags": ["under_voltage"]}}
    hostile = {k: v for k, (v, _) in HOSTILE_ENTRIES.items()}
    msg = P.decode(_raw_update({**honest, **hostile}))
    assert isinstance(msg, M.Update)
    assert msg.metrics == {**honest, "deep": {}}
    dropped = P.dropped_entries(msg)
    assert sorted(d.reason for d in dropped) == sorted(r for _, r in HOSTILE_ENTRIES.values())
    assert all(type(d) is P.DroppedEntry and "update: metrics." in str(d) for d in dropped)
    assert "metrics.note" in str(dropped[0]) and "bytes" in str(dropped[0])
    json.dumps(msg.metrics, allow_nan=False)  # what is kept is strict JSON


def test_a_map_keeps_at_most_its_declared_keys_and_bytes() -> None:
    many = {f"k{i}": i for i in range(40)}
    msg = P.decode(_raw_update(many))
    assert list(msg.metrics) == [f"k{i}" for i in range(32)]
    assert [d.reason for d in P.dropped_entries(msg)] == ["dropped_count"] * 8
    big = {f"s{i}": "x" * 128 for i in range(32)}  # 32 x ~135 bytes of JSON: over the 4096 of a hello's facts
    hello = P.decode(_edit(P.encode(M.Hello("pi-01", 10)), lambda h: h["f"].update(device=big)))
    assert 0 < len(hello.device) < 32 and len(json.dumps(hello.device, separators=(",", ":"))) <= 4096
    assert {d.reason for d in P.dropped_entries(hello)} == {"dropped_bytes"}


def test_a_hello_drops_unsafe_device_facts_and_registers() -> None:
    frame = _edit(P.encode(M.Hello("pi-01", 10)), lambda h: h["f"].update(device={"hostname": "pi", "x": b"\xff"}))
    hello = P.decode(frame)
    assert hello.device == {"hostname": "pi"} and [d.reason for d in P.dropped_entries(hello)] == ["dropped_type"]
    deep = _edit(P.encode(M.Hello("pi-01", 10)), lambda h: h["f"].update(device={"os": {"name": "linux"}}))
    assert P.decode(deep).device == {}  # facts are flat: a map in them is dropped


def test_not_a_map_refuses_the_message() -> None:
    _reject(_raw_update([1, 2]), P.InvalidField, "'metrics'", "map")


@pytest.mark.parametrize("bad", ["0.9", True, None, [0.9], {"a": 1}, 2**60, "bad key!"])
def test_evaluation_metrics_and_update_extras_refuse_what_is_not_a_number(bad: Any) -> None:
    """Numbers the server combines or checks against a contract: a missing entry would change the decision, so the
    message is refused (NaN passes here: the evaluation and the contract refuse it with their own reason)."""
    key, value = ("bad key!", 0.5) if bad == "bad key!" else ("accuracy", bad)
    report = P.encode(M.Evaluation(3, "pi-01", 50, 0.5, {"accuracy": 0.9}))
    _reject(_edit(report, lambda h: h["f"].update(metrics={key: value})), P.InvalidField, "metrics")
    _reject(_edit(GOOD, lambda h: h["f"].update(extras={key: value})), P.InvalidField, "extras")
    nan = P.decode(_edit(report, lambda h: h["f"].update(metrics={"accuracy": float("nan")})))
    assert math.isnan(nan.metrics["accuracy"])


def test_encode_leaves_out_what_a_device_may_not_send_and_refuses_bad_numbers() -> None:
    """A sensor's NaN does not stop an honest device's update: encode sends it without the entry."""
    sent = P.decode(P.encode(_update(metrics={"t": np.float32(51.5), "bad": float("nan"), "flags": ("a",)})))
    assert sent.metrics == {"t": 51.5, "flags": ["a"]} and P.dropped_entries(sent) == []
    with pytest.raises(P.InvalidField, match="extras"):
        P.encode(_update(extras={"beta": "0.3"}))


JSON_LEAVES = st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=140)
WIRE_VALUES = st.recursive(JSON_LEAVES | st.binary(max_size=4), lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.text(max_size=6), inner, max_size=4), max_leaves=12)  # fmt: skip


@settings(max_examples=150, deadline=None)
@given(st.dictionaries(st.text(max_size=8), WIRE_VALUES, max_size=40))
def test_whatever_a_device_packs_in_its_metrics_what_is_kept_is_bounded_strict_json(metrics: dict[str, Any]) -> None:
    try:
        msg = P.decode(_raw_update(metrics))
    except P.MalformedMessage:  # over the 64 KiB header
        return
    assert isinstance(msg, M.Update) and len(msg.metrics) <= 32
    text = json.dumps(msg.metrics, allow_nan=False, separators=(",", ":"))  # no bytes, NaN, Inf or huge int survives
    assert len(text) <= 8192
    for value in msg.metrics.values():
        for leaf in value.values() if isinstance(value, dict) else [value]:
            assert not isinstance(leaf, dict)  # one level of maps at most
            assert all(not isinstance(x, list | dict) for x in (leaf if isinstance(leaf, list) else []))
    said = [str(d) for d in P.dropped_entries(msg)]
    for key in set(metrics) - set(msg.metrics):  # every entry not kept was dropped with its reason
        assert any(text.startswith((f"update: metrics.{key}: ", f"update: metrics.{key}[")) for text in said), key


# ------------------------------------------------------------------------------------------------- the docs table
def test_docs_reliability_holds_the_generated_table_of_every_field_a_device_sends() -> None:
    """Regenerate with: python -c "import edge_client.wire.messages as m; print(m.device_fields_table())" and paste it
    between the markers of docs/reliability.md."""
    doc = (Path(__file__).resolve().parents[4] / "docs" / "reliability.md").read_text()
    begin, end = "<!-- device-fields:begin -->\n", "\n<!-- device-fields:end -->"
    assert doc.count(begin) == 1 and doc.count(end) == 1
    assert doc[doc.index(begin) + len(begin) : doc.index(end)] == M.device_fields_table()
    table = M.device_fields_table()
    for cls in M.FROM_DEVICES:  # every declared field of every type a device sends has its row
        for key in M.SCHEMAS[cls.TYPE].fields:
            assert f"| `{cls.TYPE}` | `{key}` |" in table
