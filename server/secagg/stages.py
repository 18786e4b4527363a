"""A secure round's stages over MQTT, in place of collecting updates: the server relays, never learns one update.

The round's assignments carry each selected device's secure terms (:meth:`SecureRounds.begin`); then
:meth:`SecureRounds.collect` runs the stages, each until every device it waits for has answered, gone offline or
failed, or until its deadline (``[privacy] stage_deadline_s``; the sharing stage, which waits for training, has the
round's deadline):

1. keys: each device advertises two public keys (before it trains); the server sends each its neighbours' keys and
   the threshold ``t`` (``SecAggRoster``).
2. shares: each device sends its neighbours' encrypted shares; the server relays to each device those meant for it
   (``SecAggRelay``), on the device's own topic.
3. masked inputs: summed in the ring as they arrive (only the running sum is kept).
4. unmasking: each device that sent a masked input is told which of its neighbours did and which dropped
   (``SecAggUnmask``) and reveals its shares; the sum is unmasked (``server.secagg.unmask``).

A stage left with fewer than ``t`` devices, a secret that cannot be rebuilt, or an unmasked mean above the clip norm
drops the round (the model stays as it was; the reason is the row's ``dropped``), never the run. Each array the
contract sums (``Contract.summed``: the delta, and SCAFFOLD's ``delta_c`` or STEM's ``v``) comes out of the one
unmasked vector as the mean of the survivors' arrays, by the weights they were masked with, and is returned once per
survivor with that survivor's scalars (steps, times, loss, telemetry), so the strategy folds it as it would their
updates: a weighted mean of identical vectors is that vector, and a ``plain`` array's mean, summed over the survivors,
is their plain sum (SCAFFOLD's ``delta_c``). FedNova's mean of each delta divided by its steps is given back to each
survivor as that mean times its steps, which FedNova divides by them again.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from edge_client.algorithms.contract import Contract
from edge_client.loop.dp import noise_std
from edge_client.secagg import parts
from edge_client.secagg.device import Keys, context_of
from edge_client.secagg.graph import neighbours
from edge_client.secagg.ring import Ring
from edge_client.wire.messages import (
    MaskedInput,
    SecAggKeys,
    SecAggRelay,
    SecAggReveal,
    SecAggRoster,
    SecAggShares,
    SecAggUnmask,
    Update,
)
from edge_client.wire.plan import Plan
from edge_client.wire.protocol import DuplicateMessage, InvalidField, OutOfRound, ProtocolError, encode
from edge_client.wire.topics import Topics
from edge_client.wire.transport import Link
from server.admission import RoundState
from server.config import PrivacySection
from server.secagg import StageRefused
from server.secagg.unmask import Ledger, Unrecoverable, unmask
from server.weight_share import capped_counts

log = logging.getLogger("edgefl.server")

STAGES = ("keys", "shares", "masked", "unmask")


@dataclass
class Outcome:
    """What a secure round produced: the updates to fold (the unmasked mean, once per survivor), or why the round is
    dropped, and its row for metrics.jsonl."""

    updates: dict[str, Update]
    dropped: str | None
    row: dict[str, Any]
    bytes_up: dict[str, int]


@dataclass
class _Round:
    """One secure round's bookkeeping on the server."""

    number: int
    run_id: str
    version: int
    terms: dict[str, dict[str, Any]]  # selected device -> its secure terms (as assigned)
    ring: Ring
    stage: str = "keys"
    keys: dict[str, Keys] = field(default_factory=dict)  # U1
    graph: dict[str, list[str]] = field(default_factory=dict)
    threshold: int = 0
    commits: dict[str, str] = field(default_factory=dict)  # U2
    sealed: dict[str, dict[str, bytes]] = field(default_factory=dict)  # owner -> holder -> its encrypted shares
    relayed: dict[str, set[str]] = field(default_factory=dict)
    masked: dict[str, MaskedInput] = field(default_factory=dict)  # U3, without their data
    total: np.ndarray | None = None
    asked: dict[str, tuple[set[str], set[str]]] = field(default_factory=dict)  # holder -> (survivors, dropped) asked
    reveals: dict[str, list[tuple[str, bool, bytes]]] = field(default_factory=dict)
    times: dict[str, float] = field(default_factory=dict)  # stage -> seconds (server clock)
    bytes_down: dict[str, int] = field(default_factory=dict)  # stage -> bytes the server sent
    bytes_up: dict[str, int] = field(default_factory=dict)  # stage -> bytes devices sent
    device_bytes: dict[str, int] = field(default_factory=dict)  # device -> every byte it sent this round


class SecureRounds:
    """The server's half of secure aggregation for one run."""

    def __init__(
        self,
        privacy: PrivacySection,
        link: Link,
        topics: Topics,
        num_params: int,
        arrived: Callable[[str], None],
        contract: Contract,
    ) -> None:
        """``contract``: the algorithm's, which says what devices mask (``Contract.summed``)."""
        self.privacy = privacy
        self.summed = contract.summed
        self.link = link
        self.topics = topics
        self.num_params = num_params
        self.arrived = arrived  # the device's answer came (server.deadlines' measurements)
        self.current: _Round | None = None

    # -- the assignments -----------------------------------------------------------------------------------------
    def begin(
        self,
        round_: int,
        run_id: str,
        version: int,
        samples: dict[str, int],
        weighting: str,
        max_share: float,
        plans: dict[str, Plan],
    ) -> dict[str, dict[str, Any]]:
        """Open ``round_`` for the selected devices (``samples``: their registered counts); each one's secure terms.
        Its weight is its share of the round's (capped) samples, or an equal share (``weighting`` uniform): the
        weights of a round sum to 1, so the weighted sum of clipped updates fits the ring. ``plans``: the devices'
        plans, whose DP noise share (``dp_noise_std``) the ring leaves room for."""
        counts = capped_counts(samples, max_share) if weighting == "samples" else dict.fromkeys(samples, 1)
        total = sum(counts.values()) or 1
        p = self.privacy
        noise = max((noise_std(plans[cid].settings) for cid in samples), default=0.0)
        ring = Ring(p.quantisation_bits, p.clip_norm, max(1, len(samples)), noise)
        terms = {
            cid: {"weight": counts[cid] / total, "clip": p.clip_norm, "bits": ring.bits, "devices": ring.devices}
            for cid in samples
        }
        self.current = _Round(round_, run_id, version, terms, ring)
        return terms

    # -- messages from devices -----------------------------------------------------------------------------------
    def take(self, sender: str, msg: SecAggKeys | SecAggShares | MaskedInput | SecAggReveal) -> None:
        """Check one stage message of ``sender`` against what its stage asked, and keep it; raises the
        ``ProtocolError`` that refuses it (counted by reason; the round goes on)."""
        r = self.current
        if msg.client_id != sender:
            raise InvalidField(f"{msg.TYPE} on the topic of {sender!r} claims client id {msg.client_id!r}")
        if r is None or msg.round != r.number or msg.run_id != r.run_id or sender not in r.terms:
            raise OutOfRound(f"{msg.TYPE} of {sender} for round {msg.round} of run {msg.run_id!r}: no such stage")
        if isinstance(msg, SecAggKeys):
            self._keys(r, sender, msg)
        elif isinstance(msg, SecAggShares):
            self._shares(r, sender, msg)
        elif isinstance(msg, MaskedInput):
            self._masked(r, sender, msg)
        else:
            self._reveal(r, sender, msg)

    @staticmethod
    def _expect(r: _Round, stage: str, sender: str, done: dict[str, Any], msg: Any) -> None:
        if sender in done:
            raise DuplicateMessage(f"{msg.TYPE} of {sender}: it sent one this round")
        if r.stage != stage:
            raise OutOfRound(f"{msg.TYPE} of {sender} in round {r.number}'s {r.stage} stage, not its {stage} stage")

    def _keys(self, r: _Round, sender: str, msg: SecAggKeys) -> None:
        self._expect(r, "keys", sender, r.keys, msg)
        taken = {k for keys in r.keys.values() for k in (keys.enc, keys.mask)}
        if msg.enc_key == msg.mask_key or {msg.enc_key, msg.mask_key} & taken:
            raise StageRefused(f"{sender} advertises a public key used twice in round {r.number}")
        r.keys[sender] = Keys(msg.enc_key, msg.mask_key)

    def _shares(self, r: _Round, sender: str, msg: SecAggShares) -> None:
        self._expect(r, "shares", sender, r.commits, msg)
        if sender not in r.graph:
            raise OutOfRound(f"{sender} shares in round {r.number} without a roster (it advertised no keys in time)")
        holders = {row[0] for row in msg.shares}
        if holders != set(r.graph[sender]):
            raise StageRefused(f"{sender} sent shares for {sorted(holders)}, its neighbours are {r.graph[sender]}")
        r.commits[sender] = msg.commitment
        r.sealed[sender] = {holder: sealed for holder, sealed in msg.shares}

    def _masked(self, r: _Round, sender: str, msg: MaskedInput) -> None:
        self._expect(r, "masked", sender, r.masked, msg)
        if sender not in r.commits:
            raise OutOfRound(f"{sender} sent a masked input in round {r.number} without taking part in sharing")
        if msg.model_version != r.version:
            raise OutOfRound(f"{sender}'s masked input trained on model version {msg.model_version}, not {r.version}")
        size = 4 * self.num_params * len(self.summed)
        if len(msg.data) != size:
            raise StageRefused(f"{sender}'s masked input has {len(msg.data)} bytes, expected {size}")
        y = np.frombuffer(msg.data, "<u4")
        r.total = y.copy() if r.total is None else r.ring.add(r.total, y)
        r.masked[sender] = MaskedInput(**{**vars(msg), "data": b""})  # its scalars; the vector is in the sum
        self.arrived(sender)

    def _reveal(self, r: _Round, sender: str, msg: SecAggReveal) -> None:
        self._expect(r, "unmask", sender, r.reveals, msg)
        if sender not in r.asked:
            raise OutOfRound(f"{sender} reveals shares in round {r.number} without being asked")
        survivors, dropped = r.asked[sender]
        for owner, is_seed, _ in msg.shares:
            if owner not in (survivors if is_seed else dropped):
                what = "seed" if is_seed else "mask key"
                raise StageRefused(f"{sender} reveals a share of {owner}'s {what}, which it was not asked for")
        r.reveals[sender] = [(owner, is_seed, share) for owner, is_seed, share in msg.shares]

    # -- the stages ------------------------------------------------------------------------------------------------
    def collect(self, state: RoundState, pump: Callable[[float], None], is_online: Callable[[str], bool]) -> Outcome:
        """Run the round's stages (``pump``: handle one message or wait up to its argument)."""
        r = self.current
        assert r is not None and r.number == state.round, "begin() the round first"
        stage_s = self.privacy.stage_deadline_s
        started = time.monotonic()
        dropped: str | None = None

        def wait(stage: str, waiting: Callable[[], set[str]], deadline: float) -> None:
            t0 = time.monotonic()
            r.stage = stage
            while True:
                left = {c for c in waiting() if c not in state.failed and is_online(c)}
                remaining = deadline - time.monotonic()
                if not left or remaining <= 0:
                    break
                pump(min(remaining, 1.0))
            r.times[stage] = time.monotonic() - t0
            r.bytes_up[stage] = sum(self._take_up(r, c) for c in r.terms)

        try:
            wait("keys", lambda: set(r.terms) - set(r.keys), time.monotonic() + stage_s)
            self._send_rosters(r)
            wait("shares", lambda: set(r.graph) - set(r.commits), started + max(state.deadline_s, stage_s))
            self._relay(r)
            wait("masked", lambda: set(r.commits) - set(r.masked), time.monotonic() + stage_s)
            self._ask_unmask(r)
            wait("unmask", lambda: set(r.asked) - set(r.reveals), time.monotonic() + stage_s)
            means = self._unmasked_means(r)
        except _Dropped as exc:
            dropped, means = exc.reason, None
            log.warning("round %d: secure aggregation dropped the round (%s): %s", r.number, exc.reason, exc)
        finally:
            r.stage = "closed"
        updates = {} if means is None else {cid: self._update(r, cid, means) for cid in sorted(r.masked)}
        return Outcome(updates, dropped, self._row(r), dict(r.device_bytes))

    def _take_up(self, r: _Round, cid: str) -> int:
        n = self.link.take_bytes_in(self.topics.up(cid))
        r.device_bytes[cid] = r.device_bytes.get(cid, 0) + n
        return n

    def _send(self, r: _Round, stage: str, cid: str, msg: Any) -> None:
        frame = encode(msg)
        r.bytes_down[stage] = r.bytes_down.get(stage, 0) + len(frame)
        self.link.publish(self.topics.down(cid), frame)

    def _send_rosters(self, r: _Round) -> None:
        ids = sorted(r.keys)
        if len(ids) < 2:
            raise _Dropped("secagg_keys", f"{len(ids)} device(s) advertised keys; a sum needs at least 2")
        r.graph = neighbours(ids, self.privacy.neighbours, seed=r.number)
        holders = 1 + min(len(vs) for vs in r.graph.values())
        t = self.privacy.threshold
        r.threshold = max(2, math.ceil(t * holders)) if t <= 1 else int(t)
        if r.threshold > holders:
            raise _Dropped("secagg_keys", f"threshold {r.threshold} above the {holders} holders of a device's shares")
        for cid in ids:
            rows = [[v, r.keys[v].enc, r.keys[v].mask] for v in r.graph[cid]]
            self._send(r, "keys", cid, SecAggRoster(r.number, r.threshold, rows, r.run_id))

    def _relay(self, r: _Round) -> None:
        sharing = sorted(r.commits)
        self._enough("secagg_shares", len(sharing), r.threshold, "sent their shares")
        for holder in sharing:
            rows = [[owner, r.sealed[owner][holder]] for owner in sharing if holder in r.sealed[owner]]
            for owner, _ in rows:
                r.relayed.setdefault(owner, set()).add(holder)
            self._send(r, "shares", holder, SecAggRelay(r.number, rows, r.run_id))
        r.sealed.clear()

    def _ask_unmask(self, r: _Round) -> None:
        survivors = set(r.masked)
        self._enough("secagg_masked", len(survivors), r.threshold, "sent a masked input")
        gone = set(r.commits) - survivors
        for holder in sorted(survivors):
            near = set(r.graph[holder])
            asked = ((near | {holder}) & survivors, near & gone)
            r.asked[holder] = asked
            self._send(r, "unmask", holder, SecAggUnmask(r.number, sorted(asked[0]), sorted(asked[1]), r.run_id))

    @staticmethod
    def _enough(reason: str, count: int, threshold: int, what: str) -> None:
        if count < threshold:
            raise _Dropped(reason, f"{count} device(s) {what}, fewer than the threshold {threshold}")

    def _unmasked_means(self, r: _Round) -> dict[str, np.ndarray]:
        """Each summed array's mean over the survivors, by the weights they masked it with."""
        assert r.total is not None
        ledger = Ledger(context_of(r.run_id, r.number), r.threshold, r.keys, r.graph, r.commits, r.relayed)
        survivors = set(r.masked)
        try:
            total = unmask(r.total, r.ring, ledger, survivors, set(r.commits) - survivors, r.reveals)
        except Unrecoverable as exc:
            raise _Dropped(exc.reason, str(exc)) from None
        means = {}
        for (name, how), part in zip(self.summed, parts.split(total, self.summed).values(), strict=True):
            weights = [parts.part_weight(how, r.terms[c]) for c in survivors]
            means[name] = mean = r.ring.decode(part) / np.float32(sum(weights))
            # each device clipped to clip_norm before weighting: no array's weighted mean can be longer, but for the
            # rounding and the noise shares (the norm of a Gaussian vector is within 10 of its std of sqrt(size) of it)
            noise = r.ring.noise * math.sqrt(sum(w * w for w in weights)) / sum(weights)
            rounding = r.ring.devices * math.sqrt(mean.size) / r.ring.scale / sum(weights)
            bound = r.ring.clip + rounding + noise * (math.sqrt(mean.size) + 10)
            norm = float(np.linalg.norm(mean.astype(np.float64)))
            if not norm <= bound:
                raise _Dropped(
                    "secagg_norm", f"the unmasked mean of {name} has norm {norm:.4g}, above the bound {bound:.4g}"
                )
        return means

    def _update(self, r: _Round, cid: str, means: dict[str, np.ndarray]) -> Update:
        m = r.masked[cid]
        delta = means["delta"]
        return Update(
            round=r.number,
            model_version=m.model_version,
            client_id=cid,
            num_samples=0,  # the strategy's sample weight (Round.sample_weights) decides; the mean is the same
            local_steps=m.local_steps,
            compute_s=m.compute_s,
            cpu_s=m.cpu_s,
            train_loss=m.train_loss,
            delta=delta * np.float32(m.local_steps) if dict(self.summed)["delta"] == "per_step" else delta,
            metrics=m.metrics,
            arrays={name: mean for name, mean in means.items() if name != "delta"},
            run_id=r.run_id,
        )

    def _row(self, r: _Round) -> dict[str, Any]:
        """The round's ``secure`` entry in metrics.jsonl."""
        survivors = set(r.masked)
        return {
            "threshold": r.threshold,
            "neighbours": max((len(v) for v in r.graph.values()), default=0),
            "advertised": len(r.keys),
            "shared": len(r.commits),
            "masked": len(survivors),
            "dropped_before_masking": sorted(set(r.commits) - survivors),
            "dropped_after_masking": sorted(survivors - set(r.reveals)),
            "stage_s": {s: r.times[s] for s in STAGES if s in r.times},  # server clock
            "bytes_down": dict(r.bytes_down),  # the server's link, per stage
            "bytes_up": dict(r.bytes_up),  # the devices' links, per stage
        }


class _Dropped(ProtocolError):
    """A stage that cannot complete: the round is dropped for ``reason``."""

    def __init__(self, reason: str, text: str) -> None:
        super().__init__(text)
        self.reason = reason
