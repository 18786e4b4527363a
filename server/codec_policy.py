"""Which upload codec each device is told: one for all (``train.codec``), or per device from its measured link.

With ``train.codec_policy = "link"`` the server keeps, per device, the last few uploads the device reported
(``metrics["last_upload"]``: the bytes it published and the seconds until the broker acknowledged them) and gives it
the first codec of ``train.codec_ladder`` (least lossy first) whose update would upload within
``train.upload_budget_s`` at that rate; if none would, the last (most compressed) one. A device whose link has not been
measured yet (its first two rounds: a device reports an upload with its next update) gets ``train.codec``.

The rate is total bytes over total seconds of the recent uploads; the seconds include the broker round trip, so a
small upload makes a link look slower than it is, and the choice errs towards compression. What a device reports is
not trusted beyond its type and range: one that claims a fast link only gets a larger upload to send in time.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any

from edge_client.algorithms.contract import Contract
from edge_client.wire import codecs
from edge_client.wire.codecs import CodecSpec

WINDOW = 5  # uploads a rate is measured over
MAX_REPORTED_BYTES = 1 << 34
MAX_REPORTED_S = 1e5
#: Bytes an update carries beside its arrays (header, metrics): a typical update header is 1-3 KiB.
HEADER_BYTES = 4096


def upload_bytes(spec: CodecSpec, contract: Contract, size: int) -> int:
    """Bytes of an update of ``contract`` for a model of ``size`` parameters sent with ``spec``."""
    return HEADER_BYTES + sum(spec.for_rule(a.codec).nbytes(size) for a in contract.uploads)


def reported_upload(metrics: dict[str, Any]) -> tuple[int, float] | None:
    """``(bytes, seconds)`` of the upload a device reports in an update's metrics, if it is plausible."""
    last = metrics.get("last_upload")
    if not isinstance(last, dict):
        return None
    sent, seconds = last.get("bytes"), last.get("upload_s")
    if not isinstance(sent, int) or isinstance(sent, bool) or not 0 < sent <= MAX_REPORTED_BYTES:
        return None
    if not isinstance(seconds, int | float) or isinstance(seconds, bool) or not math.isfinite(seconds):
        return None
    return (sent, float(seconds)) if 0 < seconds <= MAX_REPORTED_S else None


class CodecPolicy:
    """The codec of each device for the next round, from the run's configuration and what devices reported."""

    def __init__(
        self, codec: str, policy: str, budget_s: float, ladder: list[str], contract: Contract, num_params: int
    ) -> None:
        self.default = codecs.parse(codec)
        self.by_link = policy == "link"
        self.budget_s = budget_s
        self.ladder = [(spec, upload_bytes(spec, contract, num_params)) for spec in map(codecs.parse, ladder)]
        self.uploads: dict[str, deque[tuple[int, float]]] = {}

    def observe(self, client_id: str, metrics: dict[str, Any]) -> None:
        """Take in the upload an admitted update reports."""
        upload = reported_upload(metrics)
        if upload is not None:
            self.uploads.setdefault(client_id, deque(maxlen=WINDOW)).append(upload)

    def rate(self, client_id: str) -> float | None:
        """Bytes per second of the device's recent uploads, or None before any was reported."""
        recent = self.uploads.get(client_id)
        if not recent:
            return None
        return sum(b for b, _ in recent) / sum(s for _, s in recent)

    def codec_for(self, client_id: str) -> CodecSpec:
        rate = self.rate(client_id) if self.by_link else None
        if rate is None:
            return self.default
        return next((spec for spec, size in self.ladder if size / rate <= self.budget_s), self.ladder[-1][0])

    def describe(self, client_id: str) -> dict[str, Any]:
        """What metrics.jsonl records of the choice: the codec and, under the link policy, the rate it came from."""
        out: dict[str, Any] = {"codec": str(self.codec_for(client_id))}
        if self.by_link:
            out["upload_Bps"] = self.rate(client_id)
        return out
