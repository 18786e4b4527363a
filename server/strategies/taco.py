"""TACO server half (ALGORITHMS.md 2.7: Algorithm 2, eqs. 7, 9, 10, 14, 15).

Per round t, over the active (non-expelled) clients that reported: the tailored coefficients ``alpha_i^{t+1}``
(eq. 7) from this round's uploads, the alpha-weighted model average (eq. 9 with ``eta_g = K eta_l``, uniform when
every alpha is 0; stabilised across rounds by default), strikes for ``alpha_i >= kappa`` and expulsion after more
than ``lambda`` strikes (eq. 10). Each client is
told its own ``alpha_i`` next round (the plan's value ``alpha_i``, eq. 8's coefficient) and the extra model
``z_t = w_t + (1 - mean_i alpha_i)(w_t - w_{t-1})`` (eqs. 14, 15) is evaluated beside ``w_t`` every round.

Not streamed: eq. 7 weights each upload by its share of all the round's upload norms and by its cosine to the mean
of all of them (or to the last global update, ``alpha_reference = "previous_global"``), known only when the last one
is in. Uploads are kept in the strategy's ``UpdateStore`` (RAM up to its bound, then a memory-mapped file in
the run directory). Each upload's norm comes from admission and it is added to the running sum on arrival; ``finish``
then reads each upload once more: its dot with the mean gives its alpha, and its alpha-weighted add into eq. 9's sum
follows while it is still in cache (divided by the sum of the alphas at the end; the uniform mean is the running sum
when every alpha is 0). With ``"previous_global"`` the reference is known before the round, so the dots are taken on
arrival too and ``finish`` reads only the uploads whose alpha is not 0. Only ``drop_on_expel_round``, whose weights
depend on the round's expulsions, takes the dots and the weighted sum in two reads.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from edge_client.algorithms.taco import ALPHA_I, CONTRACT
from edge_client.wire.messages import Update
from edge_client.wire.plan import Plan
from server.strategies.base import Round, ServerContext, Strategy, TrainSettings
from server.strategies.common import EPS, cosine_of, normalise
from server.strategies.store import UpdateStore, held_bytes

log = logging.getLogger("edgefl.server")


def taco_alphas(deltas: list[np.ndarray], reference: str = "mean", previous: np.ndarray | None = None) -> np.ndarray:
    """Eq. 7 over one round's uploads: ``(1 - |D_i| / sum_j |D_j|) * max(cos(D_i, r), 0)``.

    ``reference = "mean"``: ``r`` is the unweighted mean of the raw uploads, eq. 7 as printed ((f)4).
    ``"previous_global"``: ``r`` is ``previous``, the global update the clients were sent this round (the prose's
    reading: the cosine between a client's update and the previous global gradient); ``None`` before the first
    aggregation, when every cosine is 0 by the C5 guard. Cosines use the C5 guard (a zero upload or reference gives
    0); when every norm is 0 (or there is one client, whose magnitude factor is 0) all alphas are 0 ((f)6).
    Returns float64 alphas in [0, 1), one per delta, in order.
    """
    if not deltas:
        return np.zeros(0)
    rows = UpdateStore(deltas[0].size)
    for i, d in enumerate(deltas):
        rows.append(str(i), d)
    return store_alphas(rows, reference, previous)[0]


def alpha_rule(norms: Sequence[float], ref_norm: float) -> Callable[[int, float], float]:
    """Eq. 7 for upload i from its dot with the reference (see ``taco_alphas``), for ``UpdateStore.scores``."""
    total = float(np.sum(norms))

    def alpha(i: int, dot: float) -> float:
        if total <= EPS:
            return 0.0
        return (1.0 - norms[i] / total) * max(cosine_of(dot, norms[i], ref_norm), 0.0)

    return alpha


def store_alphas(
    rows: UpdateStore, reference: str = "mean", previous: np.ndarray | None = None, fold: bool = False
) -> tuple[np.ndarray, np.ndarray | None]:
    """Eq. 7 (see ``taco_alphas``) over the rows of a store and, with ``fold``, ``sum_i alpha_i D_i`` in the same
    visit of each row (None when every alpha is 0 without a visit: no reference, or no norm).

    Norms and mean come from arrival; the previous global update is the store's ``reference`` when the strategy
    opened the round with it (its dots were taken on arrival too)."""
    ref = rows.mean() if reference == "mean" else previous
    ref_norm = 0.0 if ref is None else float(np.linalg.norm(ref))
    if ref is None or ref_norm < EPS or float(np.sum(rows.norms)) <= EPS:
        return np.zeros(len(rows)), None
    return rows.scores(ref, alpha_rule(rows.norms, ref_norm), fold)


def stabilised_weights(smoothed: np.ndarray, uniform_share: float) -> np.ndarray:
    """``(1 - u) s_i / sum_j s_j + u / n``: eq. 9's shares of the smoothed alphas ``s`` mixed with uniform weights
    (all uniform when every ``s_i`` is 0). Beyond the paper (docs/algorithms.md, "TACO's stabilised aggregation"):
    on label-skewed data the round's own alphas give weight only to the clients agreeing with this round's mean, and
    the model swings between label groups from round to round."""
    return (1.0 - uniform_share) * normalise(smoothed) + uniform_share / len(smoothed)


def outliers(alphas: np.ndarray, kappa: float, gap: float) -> np.ndarray:
    """The stabilised freeloader test (beyond the paper): eq. 10, ``alpha_i >= kappa``, for the clients above the
    widest gap between the round's sorted alphas, when that gap is at least ``gap`` and they are fewer than half.

    A freeloader's alpha is high every round and stands apart (TACO Table II: 0.75-0.88 against 0.18-0.43; with the
    accumulated correction 0.83-0.96 against at most 0.69, docs/reproduction.md); an honest client's passes kappa
    when every client's does (two-class data such as Adult, where eq. 10 alone strikes nearly everyone) or in the
    rounds the model swings its way, without a gap to the others. Needs the honest clients to be the majority."""
    n = len(alphas)
    out = np.zeros(n, dtype=bool)
    if n < 2:
        return out
    order = np.argsort(alphas, kind="stable")
    gaps = np.diff(alphas[order])
    widest = int(np.argmax(gaps))
    above = order[widest + 1 :]
    if gaps[widest] >= gap and len(above) < n / 2:
        out[above] = True
    return out & (alphas >= kappa)


class Taco(Strategy):
    """TACO: tailored per-client correction, alpha-weighted aggregation, freeloader expulsion, output z.

    Resolutions of ALGORITHMS.md 2.7 (f), all as [RECOMMENDED] unless noted:
    (1) ``correction = "accumulated"`` (the paper's, not ALGORITHMS.md's [RECOMMENDED] per-step reading: see
    docs/algorithms.md): the client's ``Delta_t`` is ``(w_{t-1} - w_t) / eta_l``; "per_step" divides by ``K eta_l``
    too, "model_diff" by nothing (the device half's ``DELTA_SCALE``).
    (2) Clients derive ``Delta_t`` from the two consecutive models they received. The server sends ``w_{t-1} - w_t``
    as ``arrays["global_delta"]`` when ``send_global_delta`` is true, or to any client that was not
    sent the model version immediately before the current one (late joiner, missed round, restart, or a round in
    which no update arrived so the version did not advance); the last-sent version per client is tracked.
    (3) ``alpha_i^{t+1}`` from round t's uploads weights round t's aggregation, is counted for eq. 10, and is the
    client's coefficient in round t+1. (4) ``alpha_reference``: eq. 7's cosine against the unweighted mean of the raw
    uploads ("mean", the equation) or against the global update the clients were sent ("previous_global", the
    prose); see ``taco_alphas``.
    (5) Round 1 (paper t = 0): ``Delta_0 = 0``, so clients apply no correction; ``alpha_init`` (0.1) is sent to
    clients not yet scored. (6) Degenerate norms: see ``taco_alphas``; all-zero alphas -> uniform weights.
    (7) Cumulative strikes, expel when ``strikes > lambda`` (the prose's "over lambda times"); the expelled
    client's update of its expulsion round is still aggregated (``drop_on_expel_round`` drops it); no re-admission.
    Added guard (not in the paper): a round's expulsions are skipped (strikes kept, warning logged) when they would
    leave no active client - with few, similar honest clients (e.g. 3 IID ones: alpha ~ 0.67 cos) every client can
    pass kappa, and expelling all of them would stall the run.
    (8) Freeloaders are simulated by ``edge_client.behaviours`` (upload ``w_{t-1} - w_t``, zeros at first).
    (9) ``outputs`` gives eq. 15's z every round with the mean alpha over non-expelled scored clients
    (``output = "w"`` skips it). (10) The experiments' settings: ``gamma = 1/K`` and eq. 9 weights, not the theory's
    gamma = 1 with uniform weights; ``aggregation = "stabilised"`` (the default, beyond the paper) smooths each
    client's alpha across rounds (``alpha_smoothing``) and mixes eq. 9's shares with uniform weights
    (``uniform_share``), see ``stabilised_weights``; ``"paper"`` is eq. 9 as printed. Strikes use the round's own
    alpha: eq. 10 (``detection = "paper"``), or by default only for the clients standing apart from the round
    (``detection = "stabilised"``, beyond the paper, see ``outliers``). (11) No data-size weights. (12) Partial
    participation: eq. 7 over the reporters, others keep their last alpha, strikes only when reporting,
    ``w_{t-1} - w_t`` sent explicitly to non-recipients.
    (13) The tailored FedProx / SCAFFOLD variants reuse ``taco_alphas`` (fedprox_taco.py, scaffold_taco.py).
    Table VI's ablation: ``tailored_correction = false`` makes the devices run eq. 4's plain SGD (no ``global_delta``
    is sent); ``tailored_aggregation = false`` averages uniformly (eq. 6, ``p_i = 1/N``). Both off is FedAvg plus the
    alphas, expulsion and z (the paper's row for both off on adult Dir(0.5), 78.88%, is its FedAvg figure in Table V).
    Note: ``assign`` records the client as a recipient of the current version (call it only when sending).

    Key resolutions of values the server cannot know at construction: ``gamma = 0.0`` means ``1/K`` with
    ``K = settings.local_steps`` (so the paper's grid value gamma = 0 is not expressible; use a tiny positive value);
    ``lambda_expel = 0`` means ``round(rounds / 5)`` (at least 1), with ``rounds`` (the run's total rounds, T) filled
    in from the run config by whoever builds the strategy. If both are 0 the strategy warns once and never expels.
    """

    contract = CONTRACT

    def __init__(self, settings: TrainSettings, params: dict[str, Any] | None = None, seed: int = 0) -> None:
        super().__init__(settings, params, seed)
        self.alpha: dict[str, float] = {}  # latest alpha_i (eq. 7) per scored client
        self.smoothed: dict[str, float] = {}  # alpha_i smoothed across rounds (aggregation = "stabilised")
        self.strikes: dict[str, int] = {}
        self.expelled: list[str] = []  # in order of expulsion
        self.version = 0  # aggregations so far = the model version the orchestrator sends
        self.last_sent: dict[str, int] = {}  # client -> model version it was last instructed with
        self.last_step: np.ndarray | None = None  # w_{t-1} - w_t of the last aggregation (model-difference scale)
        self._warned_lambda = False

    # -- resolved hyper-parameters -------------------------------------------------------------------------------

    @property
    def gamma(self) -> float:
        g = float(self.params["gamma"])
        return g if g > 0 else 1.0 / max(1, self.settings.local_steps)

    @property
    def lambda_expel(self) -> float:
        """Strike threshold: the configured value, else ``round(T/5)`` (>= 1), else infinity (never expel)."""
        if self.params["lambda_expel"] > 0:
            return float(self.params["lambda_expel"])
        if self.params["rounds"] > 0:
            return float(max(1, round(self.params["rounds"] / 5)))
        if not self._warned_lambda:
            self._warned_lambda = True
            log.warning(
                "%s: lambda_expel = 0 needs %s.rounds (T) for its T/5 default; no client will be expelled",
                self.name,
                self.name,
            )
        return math.inf

    def setup(self, ctx: ServerContext) -> None:
        super().setup(ctx)
        _ = self.lambda_expel  # warn at start, not mid-run, when lambda cannot be resolved

    # -- round loop --------------------------------------------------------------------------------------------

    def assign(self, round_: int, client_id: str) -> Plan:
        plan = super().assign(round_, client_id)
        plan.settings[ALPHA_I.name] = float(self.alpha.get(client_id, self.params["alpha_init"]))
        missed = self.params["send_global_delta"] or self.last_sent.get(client_id) != self.version - 1
        if self.params["tailored_correction"] and self.last_step is not None and missed:
            plan.arrays = {"global_delta": self.last_step.astype(np.float32)}
        self.last_sent[client_id] = self.version
        return plan

    def _strike(self, client_id: str, suspect: bool) -> bool:
        """Count a strike for a suspect (eq. 10, or the stabilised test); True when the client has been struck over
        lambda times (the paper's prose, "expel clients satisfying Eq. (10) over lambda times": strikes > lambda)."""
        if not suspect:
            return False
        strikes = self.strikes[client_id] = self.strikes.get(client_id, 0) + 1
        return strikes > self.lambda_expel

    def _expel(self, round_: int, candidates: list[str]) -> set[str]:
        """Expel ``candidates`` unless that would leave no active client (then nobody this round; strikes stay)."""
        if not candidates:
            return set()
        known = set(self.ctx.clients) | set(self.alpha)
        if not known - set(self.expelled) - set(candidates):
            log.warning(
                "%s: round %d: %s reached %g strikes, but expelling them would leave no client; kept for now "
                "(kappa %.2f is too low for this federation?)",
                self.name,
                round_,
                candidates,
                self.lambda_expel,
                self.params["kappa"],
            )
            return set()
        for cid in candidates:
            self.expelled.append(cid)
            log.warning(
                "%s: round %d: expelled %s as a suspected freeloader (alpha %.4f >= kappa %.2f, %d strikes, lambda %g)",
                self.name,
                round_,
                cid,
                self.alpha[cid],
                self.params["kappa"],
                self.strikes[cid],
                self.lambda_expel,
            )
        return set(candidates)

    def begin(self, round_: int, weights: np.ndarray) -> Round:
        rnd = super().begin(round_, weights)
        previous = self.params["alpha_reference"] == "previous_global"
        rnd.rows = self.update_store(weights.size, self.last_step if previous else None)
        return rnd

    def add(self, rnd: Round, update: Update) -> None:
        if update.client_id in self.expelled:
            log.warning(
                "%s: round %d: ignoring the update of expelled client %s", self.name, rnd.number, update.client_id
            )
            return
        rnd.store().append(update.client_id, update.delta, held_bytes(update), rnd.delta_norm(update))

    def close(self, rnd: Round) -> np.ndarray:
        rows = rnd.store()
        if not len(rows):  # every update came from an expelled client
            return rnd.weights
        tailored = self.params["tailored_aggregation"]
        paper = self.params["aggregation"] == "paper"
        # every update of the round counts unless expulsions drop some: eq. 9's sum is then taken beside the alphas
        fold = tailored and paper and not self.params["drop_on_expel_round"]
        alphas, alpha_sum = store_alphas(rows, self.params["alpha_reference"], self.last_step, fold)
        smoothed = self._smoothed(rows.keys, alphas)
        stabilised = self.params["detection"] == "stabilised"
        suspect = outliers(alphas, self.params["kappa"], self.params["strike_gap"]) if stabilised else None
        candidates = []
        for i, (cid, a) in enumerate(zip(rows.keys, alphas, strict=True)):
            self.alpha[cid] = float(a)
            if self._strike(cid, bool(suspect[i]) if suspect is not None else a >= self.params["kappa"]):
                candidates.append(cid)
        expelled_now = self._expel(rnd.number, sorted(candidates))  # in client order, whatever the arrival order
        chosen = np.array([cid not in expelled_now for cid in rows.keys])
        if not (self.params["drop_on_expel_round"] and chosen.any()):
            chosen[:] = True  # the expelled clients' updates of this round still count ((f)7)
        coefs = np.ones(len(rows)) if not tailored else alphas if paper else smoothed
        if chosen.all() and (not tailored or coefs.sum() <= EPS):
            step = rows.mean()  # uniform (eq. 6, or eq. 9's fallback): the running sum holds it, no pass over the rows
        elif alpha_sum is not None:  # every update counts (fold): eq. 9 from the sum taken beside the alphas
            step = alpha_sum
            step /= np.float32(alphas.sum())
        else:
            p = np.zeros(len(rows))
            p[chosen] = normalise(coefs[chosen]) if paper or not tailored else self._stabilised(coefs[chosen])
            step = rows.weighted_sum(p)  # eta_g * Delta_{t+1}
        self.last_step = step
        self.version += 1
        return rnd.weights - step

    def _smoothed(self, keys: Sequence[str], alphas: np.ndarray) -> np.ndarray:
        """Each client's alpha smoothed across the rounds it reported (an EMA starting at its first alpha)."""
        beta = float(self.params["alpha_smoothing"])
        for cid, a in zip(keys, alphas, strict=True):
            self.smoothed[cid] = beta * self.smoothed.get(cid, float(a)) + (1.0 - beta) * float(a)
        return np.array([self.smoothed[cid] for cid in keys])

    def _stabilised(self, smoothed: np.ndarray) -> np.ndarray:
        """The stabilised eq. 9 weights: the smoothed alphas' shares mixed with uniform weights."""
        return stabilised_weights(smoothed, float(self.params["uniform_share"]))

    def excluded(self) -> set[str]:
        return set(self.expelled)

    def mean_alpha(self) -> float:
        """Eq. 14 over the active (non-expelled) clients that have an alpha; ``alpha_init`` before any."""
        active = [a for c, a in self.alpha.items() if c not in self.expelled]
        return float(np.mean(active)) if active else float(self.params["alpha_init"])

    def outputs(self, weights: np.ndarray) -> dict[str, np.ndarray]:
        """Eq. 15: ``z_t = w_t + (1 - alpha_t)(w_t - w_{t-1})``; ``z_0 = w_0`` before the first aggregation."""
        if self.params["output"] != "z":
            return {}
        if self.last_step is None:
            return {"z": np.array(weights, dtype=np.float32)}
        return {"z": (weights - np.float32(1.0 - self.mean_alpha()) * self.last_step).astype(np.float32)}

    def round_metrics(self) -> dict[str, Any]:
        return {
            "alpha": dict(self.alpha),
            "smoothed_alpha": dict(self.smoothed),
            "strikes": dict(self.strikes),
            "expelled": list(self.expelled),
        }

    def state_dict(self) -> dict[str, Any]:
        """Per-client dicts (JSON in the checkpoint) and ``last_step`` (w_{t-1} - w_t, d floats: an npz array)."""
        return {
            "alpha": dict(self.alpha),
            "smoothed": dict(self.smoothed),
            "strikes": dict(self.strikes),
            "expelled": list(self.expelled),
            "version": self.version,
            "last_sent": dict(self.last_sent),
            "last_step": None if self.last_step is None else self.last_step.copy(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.alpha = {str(k): float(v) for k, v in state.get("alpha", {}).items()}
        self.smoothed = {str(k): float(v) for k, v in state.get("smoothed", {}).items()}
        self.strikes = {str(k): int(v) for k, v in state.get("strikes", {}).items()}
        self.expelled = [str(c) for c in state.get("expelled", [])]
        self.version = int(state.get("version", 0))
        self.last_sent = {str(k): int(v) for k, v in state.get("last_sent", {}).items()}
        step = state.get("last_step")
        self.last_step = None if step is None else np.asarray(step, dtype=np.float32)


class TailoredCoefficients:
    """Mixin for the (f)13 variants: tracks each client's TACO alpha_i (eq. 7) from every round's uploads.

    ``alpha_of(client)`` is ``alpha_init`` until the client's first upload; clients that do not report keep their last
    alpha ((f)12). Every plan carries it as the value ``alpha_i``; the device half tailors its own coefficient with it
    (zeta_i = zeta (1 - alpha_i), SCAFFOLD's alpha (1 - alpha_i)). With ``alpha_reference = "previous_global"`` the
    reference is the host's last global update ``w_{t-1} - w_t``.

    Streaming as far as the math allows: the aggregation (FedProx's or SCAFFOLD's) is folded on arrival as theirs is;
    the alphas need every upload's cosine to the mean, so the deltas are also kept in the store (norms from
    admission, the mean on arrival, one more read of each in ``finish``); with ``"previous_global"`` the reference is
    known in advance and the dots are taken on arrival.
    """

    params: dict[str, Any]

    def __init__(self, settings: TrainSettings, params: dict[str, Any] | None = None, seed: int = 0) -> None:
        super().__init__(settings, params, seed)  # type: ignore[call-arg]
        self.taco_alpha: dict[str, float] = {}
        self.global_step: np.ndarray | None = None  # w_{t-1} - w_t, kept for "previous_global" only

    def alpha_of(self, client_id: str) -> float:
        return self.taco_alpha.get(client_id, float(self.params["alpha_init"]))

    def assign(self, round_: int, client_id: str) -> Plan:
        plan = super().assign(round_, client_id)  # type: ignore[misc]
        plan.settings[ALPHA_I.name] = self.alpha_of(client_id)
        return plan

    def begin(self, round_: int, weights: np.ndarray) -> Round:
        rnd = super().begin(round_, weights)  # type: ignore[misc]
        previous = self.params["alpha_reference"] == "previous_global"
        rnd.rows = self.update_store(weights.size, self.global_step if previous else None)  # type: ignore[attr-defined]
        return rnd

    def add(self, rnd: Round, update: Update) -> None:
        super().add(rnd, update)  # type: ignore[misc]
        rnd.store().append(update.client_id, update.delta, held_bytes(update), rnd.delta_norm(update))

    def close(self, rnd: Round) -> np.ndarray:
        reference = self.params["alpha_reference"]
        alphas = store_alphas(rnd.store(), reference, self.global_step)[0]  # alpha_i^{t+1}, next round's coefficient
        new = super().close(rnd)  # type: ignore[misc]
        self.taco_alpha.update({cid: float(a) for cid, a in zip(rnd.store().keys, alphas, strict=True)})
        if reference == "previous_global":
            self.global_step = (rnd.weights - new).astype(np.float32)
        return new

    def round_metrics(self) -> dict[str, Any]:
        return {**super().round_metrics(), "alpha": dict(self.taco_alpha)}  # type: ignore[misc]

    def state_dict(self) -> dict[str, Any]:
        step = None if self.global_step is None else self.global_step.copy()
        return {**super().state_dict(), "taco_alpha": dict(self.taco_alpha), "global_step": step}  # type: ignore[misc]

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)  # type: ignore[misc]
        self.taco_alpha = {str(k): float(v) for k, v in state.get("taco_alpha", {}).items()}
        step = state.get("global_step")
        self.global_step = None if step is None else np.asarray(step, dtype=np.float32)
