"""How a message field is declared: its wire key, its check and the bound the docs show, in the field itself.

A message dataclass (``edge_client.wire.messages``) declares each header field with :func:`on_wire` and each array with
:func:`vector`, :func:`named_arrays` or :func:`blob`; :func:`schema_of` derives from those declarations everything
the framing (``edge_client.wire.protocol``) needs, and the docs table of what a device may send is generated from the
same declarations, so the schema is written once. A check is data (its wire type, its bound as text and a predicate), so
the error a peer gets and the docs say the same thing.

A :class:`FreeMap` is a map a device fills as it likes (telemetry, device facts, metric values): declared by what its
entries may be (JSON-safe scalars, a bounded number of keys and bytes). Entries outside are dropped with a reason, or
the whole message is refused where a missing entry would change what the server decides (``drop=False``). A
:class:`Record` is a map whose entries are another dataclass's declared fields (an assignment's plan and round facts):
each is checked by its own declaration.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import MISSING, Field, dataclass, field, fields
from typing import Any, ClassVar

import numpy as np

WIRE = "edgefl.wire"  # the dataclass field metadata key of a header field's declaration
ARRAY = "edgefl.array"  # ... of an array's


def short(v: Any) -> str:
    """``repr`` cut to 80 characters: what an error message quotes of an untrusted value."""
    r = repr(v)
    return r if len(r) <= 80 else r[:77] + "..."


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)  # bool is an int subclass: never accept it as a number


# ---------------------------------------------------------------------------------------------------------- checks
@dataclass(frozen=True)
class Check:
    """What one header field may hold: ``wire`` its msgpack type and ``bound`` the rest (the docs table's columns),
    ``expected`` the same in words (the error text), ``ok`` the test."""

    wire: str
    bound: str
    expected: str
    ok: Callable[[Any], bool]


def integer(lo: int | None = None, hi: int | None = None) -> Check:
    bound = f"in [{lo}, {hi}]" if lo is not None and hi is not None else f">= {lo}" if lo is not None else ""

    def ok(v: Any) -> bool:
        return is_int(v) and (lo is None or v >= lo) and (hi is None or v <= hi)

    return Check("int", bound, f"an int {bound}".rstrip(), ok)


def number(lo: float | None = None, *, positive: bool = False, finite: bool = True, optional: bool = False) -> Check:
    """A float (an int is taken as its float); NaN and Inf only where ``finite`` is False."""
    parts = ["finite"] if finite else ["NaN and Inf allowed"]
    parts += ["> 0"] if positive else []
    parts += [f">= {lo}"] if lo is not None else []
    parts += ["or nil"] if optional else []

    def ok(v: Any) -> bool:
        if v is None:
            return optional
        if not (is_int(v) or isinstance(v, float)):
            return False
        return (
            (not finite or not isinstance(v, float) or math.isfinite(v))
            and (not positive or v > 0)
            and (lo is None or v >= lo)
        )

    expected = "a" + (" finite" if finite else "") + " float" + (" > 0" if positive else "")
    expected += (f" >= {lo}" if lo is not None else "") + (" or None" if optional else "")
    return Check("float", ", ".join(parts), expected, ok)


def text(pattern: str | None = None, *, max_len: int | None = None, choices: tuple[str, ...] = ()) -> Check:
    compiled = re.compile(pattern) if pattern is not None else None
    bound = f"matching `{pattern}`" if pattern is not None else f"<= {max_len} chars" if max_len is not None else ""
    bound = f"one of {', '.join(choices)}" if choices else bound

    def ok(v: Any) -> bool:
        return (
            isinstance(v, str)
            and (compiled is None or compiled.fullmatch(v) is not None)
            and (max_len is None or len(v) <= max_len)
            and (not choices or v in choices)
        )

    return Check("str", bound, f"a str {bound}".rstrip(), ok)


def binary(size: int) -> Check:
    """Raw bytes of exactly ``size`` (a key, a commitment's preimage never: those are hex text)."""
    return Check("bin", f"{size} bytes", f"{size} bytes", lambda v: isinstance(v, bytes) and len(v) == size)


def rows(count: int, *columns: Check) -> Check:
    """A list of at most ``count`` rows, each a list of one value per column; the first column (an id) distinct."""
    bound = f"<= {count} rows [{', '.join(c.expected for c in columns)}], first column distinct"

    def ok(v: Any) -> bool:
        if not isinstance(v, list) or len(v) > count:
            return False
        good = all(
            isinstance(r, list) and len(r) == len(columns) and all(c.ok(x) for c, x in zip(columns, r, strict=True))
            for r in v
        )
        return good and len({r[0] for r in v}) == len(v)

    return Check("list", bound, f"a list of {bound}", ok)


FLAG = Check("bool", "", "a bool", lambda v: isinstance(v, bool))
MAPPING = Check(  # a map the server sends (its own spec, settings): its content is checked where it is used
    "map", "str keys", "a map with str keys", lambda v: isinstance(v, dict) and all(isinstance(k, str) for k in v)
)


def names(count: int = 32, length: int = 64) -> Check:
    def ok(v: Any) -> bool:
        good = isinstance(v, list) and len(v) <= count and all(isinstance(n, str) and 0 < len(n) <= length for n in v)
        return good and len(set(v)) == len(v)

    bound = f"<= {count} distinct names of 1-{length} chars"
    return Check("list", bound, f"a list of at most {count} distinct names of 1-{length} characters", ok)


# ------------------------------------------------------------------------------------------------- free-form maps
MAX_SAFE_INT = 2**53  # the integers a JSON reader (a browser's) holds exactly
MAX_STR = 128
MAX_LIST = 32
KEY_PATTERN = r"[A-Za-z_][A-Za-z0-9_.-]{0,63}"
_KEY_RE = re.compile(KEY_PATTERN)
_TYPE, _RANGE, _NON_FINITE = -1, -2, -3  # why FreeMap._scalar / _list did not take a value (a negative size)


@dataclass(frozen=True)
class FreeMap:
    """A map a device fills as it likes, declared by what its entries may be.

    Scalars: nil, bool, an int within +-2^53, a finite float, a str of at most 128 characters (``numbers`` allows
    ints and floats only; ``finite`` False lets NaN and Inf through to a check that refuses them with its own
    reason). With ``nested``, an entry may also be a list of at most 32 scalars or a map of scalars
    (one level: the per-round snapshots of ``Update.metrics``). At most ``max_keys`` keys per map, keys matching
    ``KEY_PATTERN``, at most ``max_bytes`` of JSON in all. ``drop``: an entry outside is dropped and counted as
    ``dropped_<why>`` (why: key, type, non_finite, range, count, bytes) while the message goes on; otherwise the
    message is refused (``invalid_field``).
    """

    max_keys: int = 32
    max_bytes: int = 4096
    numbers: bool = False
    nested: bool = False
    drop: bool = True
    finite: bool = True
    wire: ClassVar[str] = "map"

    @property
    def bound(self) -> str:
        real = "finite float" if self.finite else "float"
        values = f"int within +-2^53 or {real}" if self.numbers else (
            f"nil, bool, int within +-2^53, {real} or str <= {MAX_STR} chars"
        )  # fmt: skip
        nested = f"; or a list of <= {MAX_LIST} of those, or a map of those (one level)" if self.nested else ""
        return f"<= {self.max_keys} keys matching `{KEY_PATTERN}`, <= {self.max_bytes} bytes as JSON; {values}{nested}"

    @property
    def expected(self) -> str:
        return "a map with str keys"

    def ok(self, v: Any) -> bool:
        """The map as a whole (its entries are :meth:`clean`'s)."""
        return isinstance(v, dict)

    def clean(self, where: str, value: dict[Any, Any]) -> tuple[dict[str, Any], list[tuple[str, str]]]:
        """The entries that hold (numpy scalars as Python's, tuples as lists), and ``(why, text)`` for each other."""
        problems: list[tuple[str, str]] = []
        kept, _ = self._map(where, value, problems, inner=False)
        return kept, problems

    def _map(
        self, where: str, value: dict[Any, Any], problems: list[tuple[str, str]], inner: bool
    ) -> tuple[dict[str, Any], int]:
        """The entries of ``value`` that hold and their size as compact JSON (counted as they are taken: decoding
        a device's telemetry must stay cheap); ``inner``: ``value`` is itself an entry (no maps in it)."""
        kept: dict[str, Any] = {}
        size = 2  # {}
        for key, raw in value.items():
            if type(key) is not str or _KEY_RE.fullmatch(key) is None:
                path = f"{where}.{key}" if type(key) is str else f"{where}[{short(key)}]"
                problems.append(("key", f"{path}: key expected to match {KEY_PATTERN}"))
                continue
            if len(kept) >= self.max_keys:
                problems.append(("count", f"{where}.{key}: more than {self.max_keys} keys"))
                continue
            kind = type(raw)
            if kind is dict and self.nested and not inner:
                entry, add = self._map(f"{where}.{key}", raw, problems, inner=True)
            else:
                if (kind is list or kind is tuple) and self.nested:
                    entry, add = self._list(raw)
                else:
                    entry, add = self._scalar(raw)
                if add < 0:
                    problems.append(self._why(f"{where}.{key}", raw, add, in_list=False))
                    continue
            add += len(key) + 4  # "key": and the comma (a key is ASCII)
            if size + add > self.max_bytes:
                problems.append(("bytes", f"{where}.{key}: the map would exceed {self.max_bytes} bytes as JSON"))
                continue
            kept[key] = entry
            size += add
        return kept, size

    def _list(self, v: list[Any] | tuple[Any, ...]) -> tuple[Any, int]:
        """``v`` as a list of scalars this map takes and its size as JSON, or a negative size saying why not."""
        if len(v) > MAX_LIST:
            return None, _RANGE
        items, size = [], 2  # []
        for item in v:
            item, add = self._scalar(item)
            if add < 0:
                return None, add
            items.append(item)
            size += add + 1
        return items, size

    def _scalar(self, v: Any) -> tuple[Any, int]:
        """``v`` (a numpy scalar as Python's) and its size as JSON, or a negative size saying why it is not taken."""
        kind = type(v)
        if kind is float or kind is int:
            pass
        elif isinstance(v, np.generic):
            v = v.item()
            kind = type(v)
        if kind is float:
            if math.isfinite(v):
                return v, len(repr(v))
            return (v, 9) if not self.finite else (v, _NON_FINITE)  # -Infinity
        if kind is int:
            return (v, len(repr(v))) if -MAX_SAFE_INT <= v <= MAX_SAFE_INT else (v, _RANGE)
        if self.numbers:
            return v, _TYPE
        if v is None or kind is bool:
            return v, 5
        if kind is str:
            if len(v) > MAX_STR:
                return v, _RANGE
            plain = v.isascii() and v.isprintable() and '"' not in v and "\\" not in v  # as JSON, as it is
            return v, len(v) + 2 if plain else len(json.dumps(v))
        return v, _TYPE

    def _why(self, path: str, v: Any, code: int, in_list: bool) -> tuple[str, str]:
        """``(why, text)`` of an entry ``_scalar`` or ``_list`` did not take (``code``, their negative size)."""
        if not in_list and type(v) in (list, tuple) and self.nested and len(v) <= MAX_LIST:  # name the bad item
            i, item, code = next((i, x, c) for i, x in enumerate(v) if (c := self._scalar(x)[1]) < 0)
            return self._why(f"{path}[{i}]", item, code, in_list=True)
        if code == _NON_FINITE:
            return "non_finite", f"{path}: {short(v)} is not finite"
        if code == _RANGE and isinstance(v, str):
            return "range", f"{path}: a str of {len(v)} chars, expected <= {MAX_STR}"
        if code == _RANGE and isinstance(v, list | tuple):
            return "range", f"{path}: a list of {len(v)} items, expected <= {MAX_LIST}"
        if code == _RANGE:
            return "range", f"{path}: int {short(v)} is beyond +-2^53"
        what = "an int or float" if self.numbers else "a scalar"
        return "type", f"{path}: a {type(v).__name__}, expected {what}"


# ----------------------------------------------------------------------------------------------- declarations
@dataclass(frozen=True)
class Record:
    """A map whose entries are another dataclass's declared fields (an assignment's plan and round facts), each
    checked by its own declaration as a message's header fields are; ``schema`` is that dataclass's."""

    schema: Schema
    wire: ClassVar[str] = "map"

    @property
    def bound(self) -> str:
        return f"the fields of {self.schema.cls.__name__}"

    @property
    def expected(self) -> str:
        return f"a map of {self.schema.cls.__name__}'s fields"

    def ok(self, v: Any) -> bool:
        """The map as a whole (its entries are checked by the record's own declarations)."""
        return isinstance(v, dict)


def record(cls: type) -> Record:
    """The declaration of a field that carries a ``cls`` (a dataclass whose fields are declared with ``on_wire``)."""
    return Record(schema_of(cls))


@dataclass(frozen=True)
class Wire:
    """A header field's declaration: ``key`` on the wire ("" = the attribute's name), its check, whether the frame
    must carry it, and ``note``: what the server checks later (the docs table shows it)."""

    key: str
    check: Check | FreeMap | Record
    required: bool
    note: str


@dataclass(frozen=True)
class ArrayDecl:
    """An array's declaration: ``kind`` vector (one required 1-D float32 vector named as the attribute), named (the
    contract's ``x:<name>`` arrays) or blob (raw bytes named ``data``); ``compressed``: it may travel as a codec's
    wire form (``edge_client.wire.codecs``)."""

    kind: str
    compressed: bool
    doc: str


def on_wire(
    check: Check | FreeMap | Record, *, key: str = "", default: Any = MISSING, factory: Any = MISSING, note: str = ""
) -> Any:
    """A dataclass field carried in the header under ``key``; required on the wire exactly when it has no default."""
    required = default is MISSING and factory is MISSING
    return field(default=default, default_factory=factory, metadata={WIRE: Wire(key, check, required, note)})


def vector(doc: str, *, compressed: bool = False) -> Any:
    return field(metadata={ARRAY: ArrayDecl("vector", compressed, doc)})


def named_arrays(doc: str, *, compressed: bool = False) -> Any:
    return field(default_factory=dict, metadata={ARRAY: ArrayDecl("named", compressed, doc)})


def blob(doc: str) -> Any:
    return field(metadata={ARRAY: ArrayDecl("blob", False, doc)})


@dataclass(frozen=True)
class Schema:
    """Everything the framing needs of one message type, derived from its class's declarations."""

    cls: type
    fields: dict[str, tuple[str, Wire]]  # wire key -> (attribute, declaration)
    required: frozenset[str]  # wire keys
    vector: str | None  # the required 1-D float32 vector's name
    vector_compressed: bool
    named: bool  # carries the contract's named "x:<name>" arrays (in the attribute "arrays")
    named_compressed: bool
    blob: bool  # carries one raw byte blob named "data" instead of float32 arrays
    arrays: dict[str, ArrayDecl]  # attribute -> declaration

    @property
    def carries_arrays(self) -> bool:
        return self.vector is not None or self.named


def schema_of(cls: type) -> Schema:
    """``cls``'s schema. ``EVERY_FIELD_REQUIRED`` on a class: its defaults serve the code that builds one, and on the
    wire every header field must be there."""
    declared: list[tuple[Field[Any], Wire]] = [(f, f.metadata[WIRE]) for f in fields(cls) if WIRE in f.metadata]
    every = getattr(cls, "EVERY_FIELD_REQUIRED", False)
    by_key = {w.key or f.name: (f.name, w) for f, w in declared}
    arrays = {f.name: f.metadata[ARRAY] for f in fields(cls) if ARRAY in f.metadata}
    vectors = [name for name, a in arrays.items() if a.kind == "vector"]
    named = [a for name, a in arrays.items() if a.kind == "named"]
    blobs = [name for name, a in arrays.items() if a.kind == "blob"]
    if len(vectors) > 1 or len(named) > 1 or (blobs and (vectors or named)) or blobs not in ([], ["data"]):
        raise TypeError(f"{cls.__name__}: at most one vector, one named set, or one blob named 'data'")
    if any(a.kind == "named" for a in arrays.values()) and "arrays" not in arrays:
        raise TypeError(f"{cls.__name__}: the contract's named arrays are the attribute 'arrays'")
    drops = any(isinstance(w.check, FreeMap) and w.check.drop for _, w in declared)
    if drops and "dropped" not in {f.name for f in fields(cls)}:
        raise TypeError(f"{cls.__name__}: a map that drops entries needs a 'dropped' field to say which")
    return Schema(
        cls=cls,
        fields=by_key,
        required=frozenset(k for k, (_, w) in by_key.items() if w.required or every),
        vector=vectors[0] if vectors else None,
        vector_compressed=bool(vectors) and arrays[vectors[0]].compressed,
        named=bool(named),
        named_compressed=bool(named) and named[0].compressed,
        blob=bool(blobs),
        arrays=arrays,
    )
