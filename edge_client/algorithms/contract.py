"""What the two halves of an algorithm agree on, declared once per algorithm in its client file.

A :class:`Contract` names an algorithm's settings (type, default, allowed range, one meaning each), the arrays and
per-round values the server sends, and every array and value the device sends back, each with its bound. The server
half, the device half, config validation, ``--help``, the settings table of docs/algorithms.md, the device benchmark
and the server's admission of updates all read it, so no default, name or bound is written twice.

Every violation raises :class:`ContractError` with one message shape: ``<algorithm>.<key> = <value>: expected
<what is allowed>``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from edge_client.wire.codecs import RULES

if TYPE_CHECKING:
    from edge_client.wire.plan import Plan

#: Default bound on the L2 norm of every model-sized array a device sends: orders of magnitude above any honest
#: update or gradient of the shipped models (MNIST deltas and gradients stay below 10), low enough to stop a blown-up
#: or malicious one. Each array's bound can be overridden per algorithm (``max_norm_<array>``).
DEFAULT_MAX_NORM = 1e4
#: How secure aggregation sums one uploaded array (``Array.summed``, ``Contract.summed``), so that the server half
#: gets what it would have computed from the plain updates: ``weighted`` by the round's weights (each device's share
#: of the samples, or an equal share: the weighted mean comes back), ``per_step`` the same after each device divided
#: by its steps (FedNova's delta), ``plain`` with equal weights (the mean over the devices that took part comes back,
#: which the server half sums back to their plain sum: SCAFFOLD's delta_c).
SUMMED = ("weighted", "per_step", "plain")


class ContractError(ValueError):
    """A setting, array or value outside its algorithm's contract; ``reason`` feeds the rejection counters."""

    reason = "contract"


def _short(v: Any) -> str:
    r = repr(v)
    return r if len(r) <= 60 else r[:57] + "..."


@dataclass(frozen=True)
class Setting:
    """One configurable setting: ``[algorithm.<name>] <setting> = value``.

    ``device`` settings travel in every assignment (the device half reads them); the others only steer the server.
    Numeric bounds are inclusive unless ``low_open``/``high_open``.
    """

    name: str
    kind: type
    default: Any
    meaning: str
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    choices: tuple[Any, ...] = ()
    device: bool = False
    inf_disables: bool = False  # ``inf`` is allowed and switches the limit off

    def allowed(self) -> str:
        """What is allowed, in words: ``a float in (0, 1]``, ``one of 'uniform', 'samples'``, ``true or false``."""
        if self.kind is bool:
            return "true or false"
        if self.choices:
            return "one of " + ", ".join(repr(c) for c in self.choices)
        kind = {int: "an integer", float: "a number", str: "a string"}[self.kind]
        if self.low is not None and self.high is not None:
            lo, hi = "(" if self.low_open else "[", ")" if self.high_open else "]"
            return f"{kind} in {lo}{self.low:g}, {self.high:g}{hi}"
        if self.low is not None:
            inf = " (inf: no limit)" if self.inf_disables else ""
            return f"{kind} {'>' if self.low_open else '>='} {self.low:g}{inf}"
        if self.high is not None:
            return f"{kind} {'<' if self.high_open else '<='} {self.high:g}"
        return kind

    def check(self, algorithm: str, value: Any) -> Any:
        """``value`` as this setting's type (an int where a float is expected is taken), or ContractError."""
        if self.kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        ok = type(value) is self.kind
        if ok and self.kind in (int, float):
            ok = math.isfinite(value) or (self.inf_disables and value == math.inf)
            ok = ok and (self.low is None or (value > self.low if self.low_open else value >= self.low))
            ok = ok and (self.high is None or (value < self.high if self.high_open else value <= self.high))
        if ok and self.choices:
            ok = value in self.choices
        if not ok:
            raise ContractError(f"{algorithm}.{self.name} = {_short(value)}: expected {self.allowed()}")
        return value


@dataclass(frozen=True)
class Value:
    """A number one half sends the other each round (not configured): FedVeca's ``P``, ``beta``, ``delta``, ...

    Always finite and within ``[low, high]``; ``example`` stands in where no server sends it (a hand-made plan).
    """

    name: str
    meaning: str
    low: float = 0.0
    high: float = math.inf
    integer: bool = False
    required: bool = True
    example: float = 0.0

    def check(self, algorithm: str, value: Any) -> float | int:
        ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
        ok = ok and self.low <= value <= self.high and (not self.integer or isinstance(value, int))
        if not ok:
            what = "an integer" if self.integer else "a finite number"
            rng = f"[{self.low:g}, {self.high:g}]" if math.isfinite(self.high) else f">= {self.low:g}"
            raise ContractError(f"{algorithm}.{self.name} = {_short(value)}: expected {what} {rng}")
        return value


@dataclass(frozen=True)
class Array:
    """A model-sized float32 vector one half sends the other.

    ``max_norm`` bounds the L2 norm of what a device sends (configurable as ``max_norm_<name>``); ``scope`` says
    whether the server sends the same vector to every client of a round (``"global"``) or one per client. ``codec``
    says which upload codecs a device may apply to it (one of ``edge_client.wire.codecs.RULES``; arrays the server sends
    always travel as float32): ``exact`` unless the algorithm stays correct with less. ``summed``: how secure
    aggregation sums an array a device returns, one of ``SUMMED`` (a contract that ``needs`` ``sums`` declares it for
    every returned array).
    """

    name: str
    meaning: str
    max_norm: float = DEFAULT_MAX_NORM
    required: bool = True
    scope: str = "client"
    codec: str = "exact"
    summed: str = ""

    def __post_init__(self) -> None:
        if self.codec not in RULES:
            raise ValueError(f"array {self.name!r}: codec {self.codec!r} is not one of {list(RULES)}")
        if self.summed and self.summed not in SUMMED:
            raise ValueError(f"array {self.name!r}: summed {self.summed!r} is not one of {SUMMED}")


#: The update every algorithm uploads beside its contract's arrays: any codec, with error feedback for top-k.
UPDATE_DELTA = Array("delta", "w_t - w_end, the local update", codec="feedback")


def weighting(default: str) -> Setting:
    """``p_i`` over the updates received (ALGORITHMS.md C3), shared by the algorithms that offer the choice."""
    return Setting(
        "weighting", str, default, "aggregation weights: 1/|S_t| ('uniform') or D_i/D ('samples')",
        choices=("uniform", "samples"),
    )  # fmt: skip


NEEDS = ("mean", "mean_per_step", "sums", "per_device")  # Contract.needs
CARRIED = ("mean", "mean_per_step", "sums")  # what secure aggregation carries


def secure_refusal(contract: Contract) -> str:
    """Why secure aggregation cannot carry ``contract``'s algorithm ("" when it can)."""
    if contract.needs in CARRIED:
        return ""
    return f"{contract.name} needs per-device values ({contract.needs_why}), which secure aggregation hides"


#: What a DP-compatible contract also accepts (docs/privacy.md): the clip norm and the device's noise std sent in the
#: assignment's settings, and whether the update was within the clip norm (adaptive clipping's count) sent back.
DP_SENDS = (
    Value("dp_clip_norm", "C: clip everything uploaded, jointly, to this L2 norm", low=1e-12, required=False),
    Value("dp_noise_std", "std of the Gaussian noise the device adds to its clipped upload", required=False),
)
DP_RETURNS = (Value("dp_within", "1 when the upload was within dp_clip_norm before clipping", high=1, integer=True,
                    required=False),)  # fmt: skip


@dataclass(frozen=True)
class Contract:
    """Everything an algorithm's server and device halves exchange, with its bounds.

    ``unequal_steps``: the aggregation normalises each update by the steps its client took, so clients may be told
    different step counts.
    ``adaptive_steps``: the algorithm chooses each client's steps itself (FedVeca's tau), so a steps policy may lower
    them but never raise them. ``needs``: what the server half needs of what devices upload, which decides whether
    secure aggregation (it reveals only a sum) can carry it: ``mean`` (only the weighted mean of the deltas: carried),
    ``mean_per_step`` (only the weighted mean of each delta divided by its steps, and the steps: carried, each device
    divides before masking), ``sums`` (sums of the delta and of every returned array, each as its ``Array.summed``
    says: carried, all masked as one vector) or ``per_device`` (values of one device apart; ``needs_why`` says
    which: refused). ``buffered``: the
    server half may aggregate updates trained on older model versions as they arrive (``train.mode = "buffered"``,
    ``server.buffered``); ``buffered_why`` says why it can or cannot, in words the config error and docs/algorithms.md
    repeat.
    """

    name: str
    description: str
    settings: tuple[Setting, ...] = ()
    sends: tuple[Array, ...] = ()
    sends_values: tuple[Value, ...] = ()
    returns: tuple[Array, ...] = ()
    returns_values: tuple[Value, ...] = ()
    unequal_steps: bool = False
    adaptive_steps: bool = False
    needs: str = "mean"
    needs_why: str = ""
    # Differential privacy: "" when the server half releases nothing derived from device data but its running sums
    # (which server/dp noises), else why it refuses DP; dp_requires: (setting, value) pairs DP needs, e.g. weighting
    dp_refusal: str = "its server half has not been checked for differential privacy"
    dp_requires: tuple[tuple[str, Any], ...] = ()
    buffered: bool = False
    buffered_why: str = ""
    _by_name: dict[str, Setting] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        bounds = tuple(
            Setting(f"max_norm_{a.name}", float, a.max_norm, f"largest L2 norm of '{a.name}' a device may send",
                    low=0.0, low_open=True, inf_disables=True)
            for a in self.returns
        )  # fmt: skip
        if self.needs not in NEEDS or (self.needs in CARRIED) == bool(self.needs_why):
            raise ValueError(f"{self.name}: needs must be one of {NEEDS}, with needs_why exactly when not {CARRIED}")
        if self.needs == "sums" and not all(a.summed for a in self.returns):
            raise ValueError(f"{self.name}: needs 'sums', so every returned array must declare how it is summed")
        settings = self.settings + bounds
        names = [s.name for s in settings] + [v.name for v in self.sends_values]
        if len(set(names)) != len(names):
            raise ValueError(f"{self.name}: a setting or value is declared twice in {names}")
        object.__setattr__(self, "_by_name", {s.name: s for s in settings})

    @property
    def uploads(self) -> tuple[Array, ...]:
        """Every vector a device uploads: the update's ``delta``, then the contract's arrays."""
        return (UPDATE_DELTA, *self.returns)

    @property
    def summed(self) -> tuple[tuple[str, str], ...]:
        """What secure aggregation masks, in order, as ``(array, how)`` (``SUMMED``): the update's ``delta``, then
        the returned arrays when the server half ``needs`` their sums. A device masks them as one vector."""
        delta = (UPDATE_DELTA.name, "per_step" if self.needs == "mean_per_step" else "weighted")
        return (delta, *((a.name, a.summed) for a in self.returns if self.needs == "sums"))

    def codec_rule(self, array: str) -> str:
        """Which codecs ``array`` may be uploaded with (``Array.codec``); ``exact`` for one not declared."""
        return next((a.codec for a in self.uploads if a.name == array), "exact")

    @property
    def all_settings(self) -> tuple[Setting, ...]:
        """The declared settings plus one ``max_norm_<array>`` per array the device returns."""
        return tuple(self._by_name.values())

    def setting(self, name: str) -> Setting:
        return self._by_name[name]

    def dp_values(self, values: tuple[Value, ...]) -> tuple[Value, ...]:
        """``values`` (``DP_SENDS`` or ``DP_RETURNS``) when this contract accepts DP, else none."""
        return () if self.dp_refusal else values

    # -- configuration (server side) --------------------------------------------------------------------------------
    def resolve(self, given: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """Every setting of this algorithm: ``given`` (a config table) checked, the rest from the defaults."""
        given = dict(given or {})
        unknown = sorted(set(given) - set(self._by_name))
        if unknown:
            valid = ", ".join(self._by_name) or "none"
            raise ContractError(f"{self.name}.{unknown[0]}: not a setting of {self.name}; valid settings: {valid}")
        return {s.name: s.check(self.name, given[s.name]) if s.name in given else s.default for s in self.all_settings}

    def device_settings(self, resolved: Mapping[str, Any]) -> dict[str, Any]:
        """The settings sent in every assignment (the device half reads them; it holds no defaults of its own)."""
        return {s.name: resolved[s.name] for s in self.all_settings if s.device}

    def max_norm(self, resolved: Mapping[str, Any], array: str) -> float:
        return float(resolved[f"max_norm_{array}"])

    # -- what the server sends (device side) ------------------------------------------------------------------------
    def check_plan(self, plan: Plan, size: int) -> None:
        """Check a plan a device is told against the contract (ContractError before any training); it is trained as
        it arrived.

        Every device setting and every required value must be in its settings (the server always sends them),
        nothing else may be, and every array must be one the contract names, of the model's size.
        """
        settings, arrays = plan.settings, plan.arrays
        known = {s.name: s for s in self.all_settings if s.device}
        values = {v.name: v for v in (*self.sends_values, *self.dp_values(DP_SENDS))}
        for key in settings:
            if key not in known and key not in values:
                raise ContractError(f"{self.name}.{key}: the assignment carries a setting {self.name} does not declare")
        for name, s in known.items():
            if name not in settings:
                raise ContractError(f"{self.name}.{name}: missing from the assignment; expected {s.allowed()}")
            s.check(self.name, settings[name])
        for name, v in values.items():
            if name in settings:
                v.check(self.name, settings[name])
            elif v.required:
                raise ContractError(f"{self.name}.{name}: missing from the assignment ({v.meaning})")
        declared = {a.name: a for a in self.sends}
        for name, arr in arrays.items():
            if name not in declared:
                raise ContractError(f"{self.name}.{name}: the assignment carries an array {self.name} does not declare")
            if arr.shape != (size,):
                raise ContractError(f"{self.name}.{name}: expected shape ({size},), got {arr.shape}")
        missing = [a.name for a in self.sends if a.required and a.name not in arrays]
        if missing:
            raise ContractError(f"{self.name}.{missing[0]}: array missing from the assignment")

    def example_sent(self, resolved: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """Plausible settings and values for a hand-made plan (defaults and examples); no server involved."""
        out = self.device_settings(resolved or self.resolve())
        return out | {v.name: v.example for v in self.sends_values if v.required}

    # -- what the device returns (server side) ----------------------------------------------------------------------
    def check_returned(
        self, resolved: Mapping[str, Any], values: Mapping[str, Any], arrays: Mapping[str, np.ndarray], size: int
    ) -> list[tuple[str, str]]:
        """Problems of an update's values and arrays, as ``(reason, text)``; empty when it honours the contract.

        Reasons: ``missing_field``, ``invalid_field`` (undeclared or out-of-range value), ``shape``, ``non_finite``,
        ``norm`` (an array above its ``max_norm_<name>``).
        """

        def value_problems(name: str, v: Value, value: Any) -> list[tuple[str, str]]:
            try:
                v.check(self.name, value)
            except ContractError as exc:
                return [("invalid_field", str(exc))]
            return []

        def vector_problems(name: str, a: Array, arr: np.ndarray) -> list[tuple[str, str]]:
            return array_problems(f"{self.name}.{name}", arr, size, self.max_norm(resolved, name))

        declared = (*self.returns_values, *self.dp_values(DP_RETURNS))
        return self._match("value", values, declared, value_problems) + self._match(
            "array", arrays, self.returns, vector_problems
        )

    def _match(
        self, kind: str, given: Mapping[str, Any], declared: tuple[Any, ...], check: Any
    ) -> list[tuple[str, str]]:
        """Undeclared entries, missing required ones, and ``check(name, spec, value)``'s problems for the others."""
        specs = {d.name: d for d in declared}
        problems = [("invalid_field", f"{self.name}.{k}: a {kind} {self.name} does not declare")
                    for k in given if k not in specs]  # fmt: skip
        for name, spec in specs.items():
            if name in given:
                problems += check(name, spec, given[name])
            elif spec.required:
                what = "array missing" if kind == "array" else "missing"
                problems.append(("missing_field", f"{self.name}.{name}: {what} ({spec.meaning})"))
        return problems


def vector_norm(arr: np.ndarray) -> float:
    """``|arr|`` of a float32 vector in one read and no copy, the very value numpy's float32 ``norm`` gives (so the
    server's strategies can use the norm admission measured); non-finite when ``arr`` holds NaN or inf.

    A finite vector whose float32 sum of squares overflows (a norm above about 1.8e19, far beyond any bound) is
    measured again in float64, so its norm is reported as a number, not as non-finite values.
    """
    with np.errstate(over="ignore", invalid="ignore"):  # an overflow is handled below, NaN is the answer
        norm = float(np.sqrt(np.dot(arr, arr)))
    if math.isinf(norm) and np.isfinite(arr).all():
        return float(np.linalg.norm(arr.astype(np.float64)))
    return norm


def checked_norm(label: str, arr: np.ndarray, size: int, max_norm: float) -> tuple[float, list[tuple[str, str]]]:
    """The norm of one received vector (NaN when it is not a float32 vector of ``size``) and its problems: dtype,
    shape, finiteness and norm, as ``(reason, text)`` pairs (empty: acceptable)."""
    if not isinstance(arr, np.ndarray) or arr.dtype != np.float32:
        got = getattr(arr, "dtype", type(arr).__name__)
        return math.nan, [("invalid_field", f"{label}: expected float32, got {got}")]
    if arr.shape != (size,):
        return math.nan, [("shape", f"{label}: expected shape ({size},), got {arr.shape}")]
    norm = vector_norm(arr)
    if not math.isfinite(norm):
        return norm, [("non_finite", f"{label}: holds non-finite values")]
    if norm > max_norm:
        return norm, [("norm", f"{label}: L2 norm {norm:.4g} exceeds its bound {max_norm:g}")]
    return norm, []


def array_problems(label: str, arr: np.ndarray, size: int, max_norm: float) -> list[tuple[str, str]]:
    """dtype, shape, finiteness and norm of one received vector, as ``(reason, text)`` pairs (empty: acceptable)."""
    return checked_norm(label, arr, size, max_norm)[1]


def settings_rows(contracts: Iterable[Contract]) -> list[tuple[str, str, str, str, str, str]]:
    """One row per setting: algorithm, setting, type, default, allowed, meaning (``--help`` and docs/algorithms.md)."""
    rows = []
    for c in contracts:
        for s in c.all_settings:
            where = "device" if s.device else "server"
            rows.append((c.name, s.name, s.kind.__name__, _short(s.default), s.allowed(), f"{s.meaning} ({where})"))
    return rows


def settings_markdown(contracts: Iterable[Contract]) -> str:
    """The settings table of docs/algorithms.md (a test keeps the document equal to this)."""
    lines = ["| algorithm | setting | type | default | allowed | meaning |", "|---|---|---|---|---|---|"]
    for row in settings_rows(contracts):
        cells = [f"`{c}`" if i < 2 else c.replace("|", "\\|") for i, c in enumerate(row)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def codecs_markdown(contracts: Iterable[Contract]) -> str:
    """The table of docs/algorithms.md saying which uploaded arrays may travel compressed (a test keeps them equal)."""
    lines = ["| algorithm | uploaded array | codec rule | travels as |", "|---|---|---|---|"]
    for c in contracts:
        for a in c.uploads:
            if a.name != "delta":  # every algorithm's delta: the same rule, stated once above the table
                lines.append(f"| `{c.name}` | `{a.name}` | `{a.codec}` | {RULES[a.codec]} |")
    return "\n".join(lines)


def buffered_markdown(contracts: Iterable[Contract]) -> str:
    """The table of docs/algorithms.md saying which algorithms run with ``train.mode = "buffered"`` and why (a test
    keeps them equal)."""
    lines = ["| algorithm | buffered | why |", "|---|---|---|"]
    for c in contracts:
        lines.append(f"| `{c.name}` | {'yes' if c.buffered else 'no'} | {c.buffered_why.replace('|', chr(92) + '|')} |")
    return "\n".join(lines)
