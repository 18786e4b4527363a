"""Update codecs: how a float32 vector is made smaller for the wire, and checked and expanded on arrival.

A codec is named by its *spec* (configuration, assignments, metrics): ``fp32`` (as is), ``fp16``, ``int8`` (one
float32 scale per block of ``B`` entries, default 256, written ``int8:B`` otherwise; stochastic rounding, so the
decoded vector is unbiased), ``topk:F`` (the largest fraction ``F`` of the entries by magnitude, as indices and
float32 values) and ``topk:F+int8`` (those values int8-coded). On the wire an encoded vector is one entry of a frame's
array list whose dtype slot holds the *wire descriptor* (``<f2``, ``int8:B``, ``topk:K``, ``topk:K+int8:B``, with the
exact count ``K``), followed by its parts as raw little-endian arrays: 4-byte parts first, then the int8 part. Every
part is read with ``np.frombuffer`` (no copy); decoding is one vectorised pass that writes the float32 result.

Each codec is one :class:`CodecSpec` subclass (:class:`Fp32`, :class:`Fp16`, :class:`Int8`, :class:`TopK`) declaring its
spec and descriptor forms, encoding and decoding; defining the class registers it, so parsing, the help text and
decoding a frame find it. A new codec is one class here and one test.

Nothing here trusts a received frame: :func:`decode_wire` checks the descriptor, counts, indices and scales before it
allocates, and raises a :class:`CodecError` whose ``reason`` names what was wrong. Besides the codecs, this module
holds the model difference a server may broadcast instead of a model (:func:`encode_model_diff`; a device adds it to
the model it holds and checks the result's digest, ``edge_client.loop.models_cache``) and the rules an algorithm's
contract uses to say which codecs an array allows (:data:`RULES`). Dependencies: numpy only.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

F4, F2, U4, I8 = np.dtype("<f4"), np.dtype("<f2"), np.dtype("<u4"), np.dtype("i1")
DEFAULT_BLOCK = 256
MAX_BLOCK = 1 << 20
MAX_FRACTION = 0.5  # above it a top-k upload is no smaller than fp32
#: The largest scale an int8 block may carry: 128 x it is still a finite float32, so decoded values always are.
MAX_SCALE = float(np.finfo(np.float32).max) / 128.0

#: What an algorithm's contract may declare about one array it uploads (``contract.Array.codec``), and what it means.
RULES = {
    "exact": "always float32, whatever codec the device was told",
    "half": "float32, or float16 when told any lossy codec (round to nearest, relative error <= 2^-11)",
    "feedback": "the codec the device was told; what top-k leaves out is kept on the device and added to its next "
    "upload (error feedback)",
    "commit": "the codec the device was told, no residual: the device adopts the value as the server decodes it",
}


class CodecError(ValueError):
    """A codec spec or an encoded vector that cannot be used; ``reason`` feeds the rejection counters."""

    reason = "codec_payload"


class BadCount(CodecError):
    """Counts that do not fit the vector: more top-k entries than it has, a block of no entries."""

    reason = "codec_count"


class BadIndex(CodecError):
    """Top-k indices out of range, repeated or not ascending."""

    reason = "codec_index"


class BadScale(CodecError):
    """An int8 block scale that is negative, not finite or so large the decoded values would not be."""

    reason = "codec_scale"


class BadValues(CodecError):
    """Encoded values that are not finite (float16 or top-k float32 entries)."""

    reason = "non_finite"


#: Every reason an encoded vector can be refused with.
REASONS = tuple(c.reason for c in (CodecError, BadCount, BadIndex, BadScale, BadValues))


@dataclass(frozen=True)
class Encoded:
    """A vector as it travels: its wire descriptor, its length, and its parts in wire order."""

    wire: str
    size: int
    parts: tuple[np.ndarray, ...]

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)


@dataclass(frozen=True)
class Layout:
    """The parts of one wire descriptor for a vector of ``size`` entries: ``(dtype, count)`` in wire order, and the
    codec that decodes them (with the int8 block size the descriptor gave, if any)."""

    wire: str
    size: int
    parts: tuple[tuple[np.dtype, int], ...]
    codec: type[CodecSpec]
    block: int = 0

    @property
    def nbytes(self) -> int:
        return sum(dtype.itemsize * n for dtype, n in self.parts)


#: Every codec class by the name its specs start with, and by the name its wire descriptors start with.
CODECS: dict[str, type[CodecSpec]] = {}
WIRE_NAMES: dict[str, type[CodecSpec]] = {}


@dataclass(frozen=True)
class CodecSpec:
    """A codec with its parameters. A new codec is one subclass: its names and patterns below, how a spec reads
    (``from_spec``), its descriptor (``wire``), ``encode``, and how a descriptor reads (``from_wire``) and decodes
    (``decode_parts``); defining it registers it."""

    kind: ClassVar[str]  # how configurations, assignments and metrics name it (a spec starts with it)
    spec_re: ClassVar[re.Pattern[str]]  # a whole spec (default: the kind alone)
    spec_help: ClassVar[str]  # its spec forms, for the error that lists them (default: the kind)
    wire_name: ClassVar[str] = ""  # how its descriptors start ("": none, it travels as plain float32)
    wire_re: ClassVar[re.Pattern[str]]  # a whole descriptor, numbers bounded in digits (default: the name alone)
    wire_help: ClassVar[str]  # its descriptor forms (default: the name)
    lossless: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        defaults = {"spec_re": re.compile(re.escape(cls.kind)), "spec_help": cls.kind,
                    "wire_re": re.compile(re.escape(cls.wire_name)), "wire_help": cls.wire_name}  # fmt: skip
        for name, value in defaults.items():
            if name not in cls.__dict__:
                setattr(cls, name, value)
        CODECS[cls.kind] = cls
        if cls.wire_name:
            WIRE_NAMES[cls.wire_name] = cls

    def __str__(self) -> str:
        """Its spec, canonically written (``parse`` reads it back to an equal codec)."""
        return self.kind

    @classmethod
    def from_spec(cls, m: re.Match[str], text: str) -> CodecSpec:
        """The codec a matched spec names; ValueError says which parameter is out of range."""
        return cls()

    def wire(self, size: int) -> str:
        """The wire descriptor of a vector of ``size`` entries sent with this codec."""
        raise NotImplementedError

    def nbytes(self, size: int) -> int:
        """Bytes on the wire of a vector of ``size`` entries sent with this codec."""
        return layout(self.wire(size), size).nbytes

    def for_rule(self, rule: str) -> CodecSpec:
        """The codec an array declared with ``rule`` is sent with when this one is assigned."""
        if rule == "exact" or self.lossless:
            return FP32
        if rule == "half":
            return FP16
        return self

    def encode(self, x: np.ndarray, rng: np.random.Generator) -> np.ndarray | Encoded:
        """``x`` (1-D float32, finite unless lossless) coded."""
        raise NotImplementedError

    @classmethod
    def from_wire(cls, m: re.Match[str], wire: str, size: int) -> Layout:
        """The parts a matched descriptor announces for ``size`` entries; CodecError when its numbers do not fit."""
        raise NotImplementedError

    @classmethod
    def decode_parts(cls, lay: Layout, parts: list[np.ndarray]) -> np.ndarray:
        """The float32 vector the parts encode (``np.frombuffer`` views); CodecError when invalid."""
        raise NotImplementedError


def _block(text: str | None, spec: str) -> int:
    """An int8 block size as a spec writes it (absent: the default); ValueError when out of range."""
    block = int(text) if text else DEFAULT_BLOCK
    if not 1 <= block <= MAX_BLOCK:
        raise ValueError(f"codec {spec!r}: the int8 block size must be in [1, {MAX_BLOCK}]")
    return block


def _wire_block(text: str | None, wire: str) -> int:
    """An int8 block size as a descriptor carries it; BadCount when out of range."""
    block = int(text) if text else DEFAULT_BLOCK
    if not 1 <= block <= MAX_BLOCK:
        raise BadCount(f"codec {wire!r}: block size expected in [1, {MAX_BLOCK}], got {block}")
    return block


def _block_suffix(block: int) -> str:
    return "" if block == DEFAULT_BLOCK else f":{block}"


def _quantise(x: np.ndarray, block: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Per-block scales ``max|x| / 127`` and int8 values rounded stochastically: ``E[q x scale] = x``."""
    n = x.size
    blocks = -(-n // block)
    padded = np.zeros(blocks * block, np.float32)
    padded[:n] = x
    rows = padded.reshape(blocks, block)
    scales = (np.abs(rows).max(axis=1) / np.float32(127.0)).astype(np.float32)
    # divided, not multiplied by 1 / scale: a subnormal scale's inverse is infinite
    y = np.divide(rows, scales[:, None], out=np.zeros_like(rows), where=scales[:, None] > 0)
    y += rng.random(y.shape, dtype=np.float32)
    q = np.clip(np.floor(y, out=y), -127, 127).astype(I8).reshape(-1)[:n]
    return scales, q


def _dequantise(scales: np.ndarray, q: np.ndarray, block: int, out: np.ndarray) -> None:
    """``out = q x scale of its block``, one pass; the scales were checked, so ``out`` is finite."""
    if not (np.all(scales >= 0) and np.all(scales <= MAX_SCALE)):  # NaN fails both comparisons
        bad = scales[~((scales >= 0) & (scales <= MAX_SCALE))][0]
        raise BadScale(f"int8 block scale {bad!r}: expected a finite number in [0, {MAX_SCALE:.4g}]")
    full = q.size // block
    if full:
        np.multiply(
            q[: full * block].reshape(full, block), scales[:full, None], out=out[: full * block].reshape(full, block)
        )
    if q.size > full * block:
        np.multiply(q[full * block :], scales[full], out=out[full * block :])


def _half_to_single(bits: np.ndarray) -> np.ndarray:
    """Float16 bit patterns as float32, exactly (every pattern is tested), or BadValues for Inf and NaN. Sign-extended
    and shifted, sign, exponent and mantissa land in place; rescaling by 2^112 fixes the exponent bias and turns
    subnormals into normals, and an exponent of all ones becomes a magnitude >= 2^16, beyond float16's largest finite
    value. Three passes and two reductions, no temporaries: about twice numpy's own conversion."""
    out = np.left_shift(bits.view("<i2"), 13, dtype=np.int32)
    np.bitwise_and(out, np.int32(-0x70002000), out=out)  # 0x8FFFE000: the sign, exponent and mantissa bits
    single = out.view(F4)
    single *= np.float32(2.0**112)
    if single.max(initial=0.0) >= 65536.0 or single.min(initial=0.0) <= -65536.0:
        raise BadValues("float16 values not finite")
    return single


@dataclass(frozen=True)
class Fp32(CodecSpec):
    """As is: the frame carries the float32 vector itself, and the receiver judges its values."""

    kind = "fp32"
    lossless = True

    def wire(self, size: int) -> str:
        return F4.str

    def nbytes(self, size: int) -> int:
        return 4 * size

    def encode(self, x: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        return x


@dataclass(frozen=True)
class Fp16(CodecSpec):
    """Float16, rounded to nearest; a vector with a value beyond float16's range goes as float32 instead."""

    kind = "fp16"
    wire_name = F2.str

    def wire(self, size: int) -> str:
        return F2.str

    def encode(self, x: np.ndarray, rng: np.random.Generator) -> np.ndarray | Encoded:
        if x.size and float(np.abs(x).max()) > float(np.finfo(np.float16).max):
            return x
        return Encoded(self.wire(x.size), x.size, (x.astype(F2),))

    @classmethod
    def from_wire(cls, m: re.Match[str], wire: str, size: int) -> Layout:
        return Layout(wire, size, ((F2, size),), cls)

    @classmethod
    def decode_parts(cls, lay: Layout, parts: list[np.ndarray]) -> np.ndarray:
        return _half_to_single(parts[0])


@dataclass(frozen=True)
class Int8(CodecSpec):
    """One float32 scale per block of ``block`` entries and int8 values rounded stochastically (unbiased)."""

    block: int = DEFAULT_BLOCK
    kind = "int8"
    spec_re = re.compile(r"int8(?::(\d+))?")
    spec_help = "int8, int8:B (block size B)"
    wire_name = "int8"
    wire_re = re.compile(r"int8:(\d{1,7})")
    wire_help = "int8:B"

    def __str__(self) -> str:
        return self.kind + _block_suffix(self.block)

    @classmethod
    def from_spec(cls, m: re.Match[str], text: str) -> CodecSpec:
        return cls(_block(m.group(1), text))

    def wire(self, size: int) -> str:
        return f"int8:{self.block}"

    def encode(self, x: np.ndarray, rng: np.random.Generator) -> Encoded:
        return Encoded(self.wire(x.size), x.size, _quantise(x, self.block, rng))

    @classmethod
    def from_wire(cls, m: re.Match[str], wire: str, size: int) -> Layout:
        block = _wire_block(m.group(1), wire)
        return Layout(wire, size, ((F4, -(-size // block)), (I8, size)), cls, block)

    @classmethod
    def decode_parts(cls, lay: Layout, parts: list[np.ndarray]) -> np.ndarray:
        out = np.empty(lay.size, F4)
        _dequantise(parts[0], parts[1], lay.block, out)
        return out


@dataclass(frozen=True)
class TopK(CodecSpec):
    """The largest fraction ``fraction`` of the entries by magnitude, as ascending indices and their float32 values,
    or (``int8``) those values int8-coded in blocks of ``block``."""

    fraction: float = 0.0
    int8: bool = False
    block: int = DEFAULT_BLOCK
    kind = "topk"
    spec_re = re.compile(r"topk:([0-9.eE+-]+?)(\+int8(?::(\d+))?)?")
    spec_help = f"topk:F or topk:F+int8 (0 < F <= {MAX_FRACTION})"
    wire_name = "topk"
    wire_re = re.compile(r"topk:(\d{1,10})(?:\+int8:(\d{1,7}))?")
    wire_help = "topk:K or topk:K+int8:B"

    def __str__(self) -> str:
        return f"topk:{self.fraction!r}" + (f"+int8{_block_suffix(self.block)}" if self.int8 else "")

    @classmethod
    def from_spec(cls, m: re.Match[str], text: str) -> CodecSpec:
        block = _block(m.group(3), text)
        try:
            fraction = float(m.group(1))
        except ValueError:
            raise ValueError(f"codec {text!r}: F must be a number in (0, {MAX_FRACTION}]") from None
        if not 0.0 < fraction <= MAX_FRACTION:
            raise ValueError(f"codec {text!r}: F must be in (0, {MAX_FRACTION}] (above it top-k sends more than fp32)")
        return cls(fraction, m.group(2) is not None, block)

    def count(self, size: int) -> int:
        """``K``, the entries kept of ``size``: ceil(F x size), at least one."""
        return min(size, max(1, math.ceil(self.fraction * size)))

    def wire(self, size: int) -> str:
        return f"topk:{self.count(size)}" + (f"+int8:{self.block}" if self.int8 else "")

    def encode(self, x: np.ndarray, rng: np.random.Generator) -> Encoded:
        k = self.count(x.size)
        idx = np.sort(np.argpartition(np.abs(x), x.size - k)[x.size - k :]).astype(U4) if k else np.zeros(0, U4)
        values = x[idx]
        if not self.int8:
            return Encoded(self.wire(x.size), x.size, (idx, values))
        return Encoded(self.wire(x.size), x.size, (idx, *_quantise(values, self.block, rng)))

    @classmethod
    def from_wire(cls, m: re.Match[str], wire: str, size: int) -> Layout:
        block = _wire_block(m.group(2), wire)
        k = int(m.group(1))
        if not (1 <= k <= size or k == size == 0):
            raise BadCount(f"codec {wire!r}: top-k count expected in [1, {size}] for {size} entries, got {k}")
        if m.group(2) is None:
            return Layout(wire, size, ((U4, k), (F4, k)), cls)
        return Layout(wire, size, ((U4, k), (F4, -(-k // block)), (I8, k)), cls, block)

    @classmethod
    def decode_parts(cls, lay: Layout, parts: list[np.ndarray]) -> np.ndarray:
        out = np.zeros(lay.size, F4)
        idx = parts[0]
        if idx.size and (int(idx[-1]) >= lay.size or not np.all(idx[1:] > idx[:-1])):
            where = "out of range" if int(idx.max()) >= lay.size else "repeated or not ascending"
            raise BadIndex(f"top-k indices {where} for {lay.size} entries (they must ascend strictly below it)")
        if len(parts) == 2:
            values = parts[1]
            if not np.isfinite(values).all():
                raise BadValues("top-k values not finite")
        else:
            values = np.empty(idx.size, F4)
            _dequantise(parts[1], parts[2], lay.block, values)
        out[idx] = values
        return out


FP32, FP16 = Fp32(), Fp16()
SPEC_HELP = ", ".join(c.spec_help for c in CODECS.values())
WIRE_HELP = ", ".join(c.wire_help for c in WIRE_NAMES.values() if c.wire_help)


def parse(text: str) -> CodecSpec:
    """The codec named ``text``, or ValueError saying what is allowed."""
    codec = CODECS.get(text.split(":", 1)[0]) if isinstance(text, str) else None
    m = codec.spec_re.fullmatch(text) if codec else None
    if codec is None or m is None:
        raise ValueError(f"unknown codec {text!r}; expected {SPEC_HELP}")
    return codec.from_spec(m, text)


# ---------------------------------------------------------------------------------------------------------- encode
def encode(x: np.ndarray, spec: CodecSpec, rng: np.random.Generator) -> np.ndarray | Encoded:
    """``x`` (1-D) coded with ``spec``. fp32 returns ``x`` itself (the frame writes it as today, and the receiver
    judges its values); so does fp16 when a value lies beyond float16's range. Other codecs need finite values."""
    x = np.ascontiguousarray(x, F4)
    if x.ndim != 1:
        raise ValueError(f"codecs encode 1-D vectors, got shape {x.shape}")
    if not spec.lossless and not np.isfinite(x).all():
        raise ValueError(f"cannot encode a vector with non-finite values as {spec}")
    return spec.encode(x, rng)


# ---------------------------------------------------------------------------------------------------------- decode
def _wire_match(wire: object) -> tuple[type[CodecSpec], re.Match[str]] | None:
    codec = WIRE_NAMES.get(wire.split(":", 1)[0]) if isinstance(wire, str) else None
    m = codec.wire_re.fullmatch(wire) if codec else None  # type: ignore[arg-type]
    return (codec, m) if codec and m else None


def is_wire(text: object) -> bool:
    """Whether ``text`` has the form of a codec's wire descriptor (its numbers are checked by :func:`layout`)."""
    return _wire_match(text) is not None


def layout(wire: str, size: int) -> Layout:
    """The parts a descriptor announces, checked against the vector's length before anything is read."""
    found = _wire_match(wire)
    if found is None:
        raise CodecError(f"unknown codec descriptor {wire!r}; expected {WIRE_HELP}")
    codec, m = found
    return codec.from_wire(m, wire, size)


def decode_parts(lay: Layout, parts: list[np.ndarray]) -> np.ndarray:
    """The float32 vector the parts of ``lay`` encode (parts as ``np.frombuffer`` views); CodecError when invalid."""
    return lay.codec.decode_parts(lay, parts)


def decode_wire(wire: str, size: int, buffer: bytes | bytearray | memoryview, offset: int) -> np.ndarray:
    """Decode the vector of ``size`` entries at ``offset`` of ``buffer`` (its bytes were accounted for)."""
    lay = layout(wire, size)
    parts = []
    for dtype, n in lay.parts:
        parts.append(np.frombuffer(buffer, dtype, n, offset))
        offset += dtype.itemsize * n
    return decode_parts(lay, parts)


def decode(enc: Encoded) -> np.ndarray:
    """The float32 vector ``enc`` stands for (what the receiver of its frame will get)."""
    return decode_parts(layout(enc.wire, enc.size), list(enc.parts))


# ------------------------------------------------------------------------------------------------ model difference
def encode_model_diff(
    base: np.ndarray, target: np.ndarray, spec: CodecSpec, rng: np.random.Generator
) -> tuple[Encoded | np.ndarray, np.ndarray]:
    """``target - base`` coded with ``spec``, and the model a device holding ``base`` rebuilds from it.

    The rebuilt model, not ``target``, is what the sender must publish (and hash): the difference is lossy, and every
    device must train from the same vector.
    """
    diff = encode(np.subtract(target, base, dtype=np.float32), spec, rng)
    rebuilt = np.add(base, diff if isinstance(diff, np.ndarray) else decode(diff), dtype=np.float32)
    return diff, rebuilt
