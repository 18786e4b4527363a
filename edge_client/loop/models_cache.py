"""The round models a device holds, and what it does when an assignment names one it has not got.

Each round's model reaches every device once (a ``GlobalModel`` on the job's round-model topics); an assignment only
names it by sha256. A device keeps the newest models it has verified (their bytes hash to the digest they claim), so a
version it holds is never fetched again. A broadcast may instead carry the difference from the previous version (the
server's ``train.downlink_codec``): the device adds it to that version, if it holds it, and keeps the result when it
hashes to the digest announced; otherwise the assignment naming it asks the server at once. An assignment whose model is
missing waits ``wait_s`` for a broadcast still on its way (a broker may deliver another topic first), then asks the
server once (``ModelRequest``; the answer comes on the device's own topic), and is reported as a ``Failure`` when no
model of that digest has arrived by the round's deadline or when one arrives whose bytes do not match it: a device never
trains on a model it cannot verify.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from edge_client.wire.messages import Assignment, GlobalModel, model_digest

log = logging.getLogger(__name__)

#: How long an assignment waits for its round's broadcast before the device asks the server for the model.
DEFAULT_WAIT_S = 2.0


class ModelCache:
    """Verified models by sha256, newest last; at most ``keep`` (a model is the size of the device's own)."""

    def __init__(self, keep: int = 2) -> None:
        self.keep = keep
        self._models: OrderedDict[str, GlobalModel] = OrderedDict()
        self.missed = ""  # sha256 of the last broadcast difference this device could not rebuild a model from

    def add(self, model: GlobalModel) -> bool:
        """Keep ``model`` (rebuilt from its base when it is a difference) if its bytes hash to the digest it claims;
        False (and nothing kept) otherwise."""
        if model.sha256 in self._models:
            self._models.move_to_end(model.sha256)
            return True
        if model.diff_base:
            base = self._models.get(model.diff_base)
            if base is None or base.weights.shape != model.weights.shape:
                log.warning("round %d: a model difference from %s, which this device does not hold", model.round,
                            model.diff_base[:12])  # fmt: skip
                self.missed = model.sha256
                return False
            weights = np.add(base.weights, model.weights, dtype=np.float32)
            model = dataclasses.replace(model, weights=weights, diff_base="")
        if model_digest(model.weights, model.arrays) != model.sha256:
            log.error("round %d: a model claiming sha256 %s does not hash to it; dropped", model.round, model.sha256)
            self.missed = model.sha256
            return False
        self._models[model.sha256] = model
        while len(self._models) > self.keep:
            self._models.popitem(last=False)
        return True

    def __contains__(self, sha256: str) -> bool:
        return sha256 in self._models

    def complete(self, assignment: Assignment) -> None:
        """Put into ``assignment``'s plan what travelled in its round's model (held: ``in``): the weights to start
        from and the shared arrays it names, beside its own arrays. The plan is not copied.

        Raises ValueError when the model lacks an array the assignment names.
        """
        model = self._models[assignment.facts.sha256]
        missing = [n for n in assignment.global_arrays if n not in model.arrays]
        if missing:
            raise ValueError(f"the round's model has no array {missing[0]!r} (it has {sorted(model.arrays)})")
        shared = {n: model.arrays[n] for n in assignment.global_arrays}
        plan = assignment.plan
        plan.weights, plan.arrays = model.weights, {**shared, **assignment.arrays}


@dataclass
class Waiting:
    """An assignment whose model has not arrived yet, and whether the server was asked for it."""

    assignment: Assignment
    since: float  # time.monotonic() when it arrived
    requested: bool = False

    def due(self, now: float, wait_s: float) -> str | None:
        """``"request"`` once ``wait_s`` has passed without the model, then ``"give_up"`` at the round's deadline."""
        if not self.requested and now >= self.since + wait_s:
            return "request"
        if self.requested and now >= self.since + self.assignment.facts.deadline_s:
            return "give_up"
        return None
