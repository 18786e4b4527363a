"""Upload codecs (edge_client/wire/codecs.py): round trips on random and adversarial vectors, int8's unbiasedness, the
exact float16 expansion, wire sizes, spec parsing, and the model difference with its hash check."""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest

from edge_client.loop.models_cache import ModelCache
from edge_client.wire import codecs as C
from edge_client.wire.messages import GlobalModel, Update, model_digest
from edge_client.wire.protocol import NonFiniteValues, decode, encode
from edgefl_testkit.messages import assignment

SPECS = ["fp32", "fp16", "int8", "int8:64", "topk:0.01", "topk:0.1+int8", "topk:0.5+int8:7"]


def rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)


def wire_round_trip(x: np.ndarray, spec: str, seed: int = 0) -> tuple[np.ndarray, Update]:
    """``x`` encoded, sent in an update frame and decoded as the server does; the decoded delta and the update."""
    enc = C.encode(x, C.parse(spec), rng(seed))
    update = decode(encode(Update(1, 0, "pi-01", 10, 1, 0.0, 0.0, 0.0, enc)))
    assert isinstance(update, Update)
    return update.delta, update


def adversarial(d: int) -> dict[str, np.ndarray]:
    huge = np.zeros(d, np.float32)
    huge[d // 3] = 3e38  # one entry near float32's largest
    tiny = np.full(d, 1e-40, np.float32)  # subnormals everywhere
    mixed = rng(1).standard_normal(d).astype(np.float32)
    mixed[::7] = 0.0
    return {"zeros": np.zeros(d, np.float32), "one huge entry": huge, "subnormal": tiny, "mixed signs": mixed}


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("d", [1, 255, 256, 1001])
def test_round_trip_of_random_vectors_through_a_frame(spec: str, d: int) -> None:
    x = rng(d).standard_normal(d).astype(np.float32)
    s = C.parse(spec)
    got, update = wire_round_trip(x, spec)
    assert got.dtype == np.float32 and got.shape == (d,)
    enc = C.encode(x, s, rng())
    assert np.array_equal(got, C.decode(enc) if isinstance(enc, C.Encoded) else enc)  # the wire changes nothing
    if s.kind == "fp32":
        assert np.array_equal(got, x) and update.codecs == {}
        return
    assert update.codecs == {"delta": s.wire(d)}
    if s.kind == "fp16":
        assert np.array_equal(got, x.astype(np.float16).astype(np.float32))
        return
    kept = np.arange(d)
    if s.kind == "topk":
        kept = np.flatnonzero(got)
        k = s.count(d)
        assert kept.size <= k and np.abs(x[kept]).min() >= np.sort(np.abs(x))[-k]  # the largest k by magnitude
        assert np.all(got[np.setdiff1d(np.arange(d), kept)] == 0)
        if not s.int8:
            assert np.array_equal(got[kept], x[kept])
            return
    # int8: each value within one quantisation step of its block's scale (max |x| / 127)
    values = x[kept] if s.kind == "topk" else x
    blocks = np.arange(values.size) // s.block
    step = np.array([np.abs(values[blocks == b]).max() / 127 for b in blocks])
    assert np.all(np.abs(got[kept] - values) <= step * 1.0001)


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("case", ["zeros", "one huge entry", "subnormal", "mixed signs"])
def test_round_trip_of_adversarial_vectors(spec: str, case: str) -> None:
    x = adversarial(300)[case]
    got, _ = wire_round_trip(x, spec)
    assert np.all(np.isfinite(got))
    if case == "zeros":
        assert not got.any()
    if case == "one huge entry":
        s = C.parse(spec)
        if s.kind in ("fp32", "int8", "topk"):  # kept exactly or as 127 x (3e38 / 127); fp16 cannot hold it
            assert got[100] == pytest.approx(3e38, rel=1e-6)
        if s.kind == "fp16":  # beyond float16's range: sent as float32 rather than as infinity
            assert np.array_equal(got, x)
    if case == "subnormal" and C.parse(spec).kind == "int8":  # a subnormal scale still rebuilds the values
        assert np.allclose(got, x, rtol=0.02, atol=0)
    if case == "mixed signs" and C.parse(spec).kind == "int8":
        assert np.all(np.sign(got[got != 0]) == np.sign(x[got != 0]))  # rounding never flips a sign


@pytest.mark.parametrize("spec", [s for s in SPECS if s != "fp32"])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_input_is_refused_by_lossy_codecs(spec: str, bad: float) -> None:
    x = np.ones(50, np.float32)
    x[7] = bad
    with pytest.raises(ValueError, match="non-finite"):
        C.encode(x, C.parse(spec), rng())


def test_fp32_sends_non_finite_values_as_they_are_and_the_receiver_refuses_them() -> None:
    x = np.ones(5, np.float32)
    x[2] = np.nan
    assert C.encode(x, C.FP32, rng()) is not None
    with pytest.raises(NonFiniteValues):
        wire_round_trip(x, "fp32")


@pytest.mark.parametrize("spec", ["int8", "int8:16", "topk:0.5+int8"])
def test_int8_is_unbiased_in_expectation(spec: str) -> None:
    """The mean of many independent encodings tends to x: within 5 standard errors of the rounding noise."""
    x = rng(3).standard_normal(64).astype(np.float32)
    s = C.parse(spec)
    n = 4000
    total = np.zeros(64, np.float64)
    for i in range(n):
        total += C.decode(C.encode(x, s, rng(1000 + i)))
    mean = total / n
    scale = np.abs(x).max() / 127  # the largest block scale (top-k: the same entries each time)
    kept = np.flatnonzero(mean) if s.kind == "topk" else np.arange(64)
    assert np.all(np.abs(mean[kept] - x[kept]) <= 5 * (scale / 2) / np.sqrt(n))
    # and a single encoding does round: some value differs from x by more than float32 noise
    one = C.decode(C.encode(x, s, rng(1)))
    assert np.abs(one[kept] - x[kept]).max() > 1e-3 * scale


def test_float16_expansion_is_exact_for_every_finite_bit_pattern() -> None:
    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    finite = bits[(bits & 0x7C00) != 0x7C00]
    raw = finite.astype("<u2").tobytes()
    got = C.decode_wire("<f2", finite.size, raw, 0)
    want = finite.view(np.float16).astype(np.float32)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))  # bit for bit, -0 and subnormals included


def test_float16_expansion_refuses_every_infinite_and_nan_bit_pattern() -> None:
    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    for pattern in bits[(bits & 0x7C00) == 0x7C00]:  # 2,048 patterns: +-Inf and every NaN
        raw = np.array([0x3C00, pattern, 0xBC00], "<u2").tobytes()  # 1.0, the pattern, -1.0
        with pytest.raises(C.BadValues):
            C.decode_wire("<f2", 3, raw, 0)


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("d", [0, 1, 44_426])
def test_wire_size_is_what_the_layout_and_the_policy_count(spec: str, d: int) -> None:
    s = C.parse(spec)
    x = rng(d).standard_normal(d).astype(np.float32)
    enc = C.encode(x, s, rng())
    assert enc.nbytes == s.nbytes(d)
    if isinstance(enc, C.Encoded):
        assert enc.wire == s.wire(d) and C.layout(enc.wire, d).nbytes == enc.nbytes


def test_the_sizes_that_matter() -> None:
    d = 44_426  # the TACO CNN
    assert C.parse("int8").nbytes(d) / (4 * d) == pytest.approx(0.2539, abs=1e-4)
    assert C.parse("topk:0.01+int8").nbytes(d) / (4 * d) < 0.013
    assert C.parse("topk:0.01").count(d) == 445


@pytest.mark.parametrize(
    "text, canonical",
    [("fp32", "fp32"), ("int8", "int8"), ("int8:256", "int8"), ("int8:64", "int8:64"), ("topk:0.01", "topk:0.01"),
     ("topk:1e-2+int8", "topk:0.01+int8"), ("topk:0.5+int8:32", "topk:0.5+int8:32")],
)  # fmt: skip
def test_specs_parse_and_print_canonically(text: str, canonical: str) -> None:
    assert str(C.parse(text)) == canonical
    assert C.parse(str(C.parse(text))) == C.parse(text)


@pytest.mark.parametrize(
    "text, expected",
    [("int9", "expected fp32, fp16"), ("topk:0", "(0, 0.5]"), ("topk:0.6", "more than fp32"), ("topk:x", "unknown"),
     ("int8:0", "block size"), ("topk:0.1+fp16", "unknown"), ("", "unknown"), ("FP32", "unknown")],
)  # fmt: skip
def test_bad_specs_say_what_is_allowed(text: str, expected: str) -> None:
    with pytest.raises(ValueError, match=expected.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        C.parse(text)


def test_rules_pick_the_codec_an_array_allows() -> None:
    topk = C.parse("topk:0.01+int8")
    assert topk.for_rule("feedback") == topk and topk.for_rule("commit") == topk
    assert topk.for_rule("half") == C.FP16 and topk.for_rule("exact") == C.FP32
    assert C.FP32.for_rule("half") == C.FP32  # nothing is compressed when fp32 was told


# ------------------------------------------------------------------------------------------------ model difference
def test_model_difference_rebuilds_the_published_model_and_checks_its_hash() -> None:
    base = rng(1).standard_normal(1000).astype(np.float32)
    target = base + rng(2).standard_normal(1000).astype(np.float32) * np.float32(0.01)
    diff, rebuilt = C.encode_model_diff(base, target, C.parse("int8"), rng())
    assert isinstance(diff, C.Encoded) and diff.nbytes < 0.3 * 4 * base.size
    assert np.abs(rebuilt - target).max() <= np.abs(target - base).max() / 127 * 1.0001
    held, sha = GlobalModel(1, 0, model_digest(base, {}), base), model_digest(rebuilt, {})
    broadcast = decode(encode(GlobalModel(2, 1, sha, diff, diff_base=held.sha256)))  # the difference, decoded
    assert isinstance(broadcast, GlobalModel)
    named = assignment(None, 1, 0.1, 8, sha256=sha)
    cache = ModelCache()
    assert not cache.add(broadcast) and cache.missed == sha  # without the base: nothing kept, the full model asked for
    assert cache.add(held) and cache.add(broadcast)
    cache.complete(named)
    assert np.array_equal(named.plan.weights, rebuilt)  # bit for bit what the server published
    wrong = dataclasses.replace(broadcast, sha256=model_digest(target, {}))  # announced: a model it does not rebuild
    other = ModelCache()
    assert other.add(held) and not other.add(wrong) and other.missed == wrong.sha256
    short = dataclasses.replace(broadcast, weights=broadcast.weights[:10])  # a difference for another model's size
    assert not other.add(short)


# ------------------------------------------------------------------------------------------------ a new codec
def test_a_new_codec_is_one_class_that_travels_in_a_frame(monkeypatch: pytest.MonkeyPatch) -> None:
    """bfloat16 (float32's upper half, truncated), defined here as one class: defining it registers its spec and its
    descriptor, so an update frame carries it and the receiver's checks and decoding find it."""
    monkeypatch.setattr(C, "CODECS", dict(C.CODECS))  # registered for this test only
    monkeypatch.setattr(C, "WIRE_NAMES", dict(C.WIRE_NAMES))

    @dataclasses.dataclass(frozen=True)
    class Bf16(C.CodecSpec):
        kind = wire_name = "bf16"

        def wire(self, size: int) -> str:
            return "bf16"

        def encode(self, x: np.ndarray, rng: np.random.Generator) -> C.Encoded:
            return C.Encoded("bf16", x.size, ((x.view("<u4") >> 16).astype("<u2"),))

        @classmethod
        def from_wire(cls, m: re.Match[str], wire: str, size: int) -> C.Layout:
            return C.Layout(wire, size, ((np.dtype("<u2"), size),), cls)

        @classmethod
        def decode_parts(cls, lay: C.Layout, parts: list[np.ndarray]) -> np.ndarray:
            return (parts[0].astype("<u4") << 16).view("<f4")

    x = rng(4).standard_normal(1000).astype(np.float32)
    assert C.parse("bf16") == Bf16() and C.parse("bf16").nbytes(1000) == 2000
    got, update = wire_round_trip(x, "bf16")
    assert update.codecs == {"delta": "bf16"}
    assert np.array_equal(got.view("<u4"), x.view("<u4") & 0xFFFF0000)  # what truncation keeps, bit for bit
