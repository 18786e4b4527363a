"""The model each device is sent: the full model, or (``train.downlink_codec = "int8"``) the int8-coded difference
from the previous round's model to a device that holds it.

A lossy difference means the model devices train from, the *published* model ``m_t``, is not exactly the server's
``w_t``: ``m_t = m_{t-1} + Q(w_t - m_{t-1})``. Every device of a round trains from the same ``m_t`` (a device without
``m_{t-1}`` is sent ``m_t`` itself), named by its sha256, which a device checks after applying a difference. What
``Q`` left out stays in ``w_t - m_t`` and is part of the next difference (error feedback on the server), so it is
never lost; the server keeps aggregating, evaluating and checkpointing ``w_t``.

A device holds ``m_{t-1}`` when its update of round t-1 was admitted (it trained from that model after checking its
hash). One that says hello again (it restarted) or reports that it could not use a difference (a Failure with
reason ``model_mismatch``) is sent the full model next. A resumed server starts with full models.
"""

from __future__ import annotations

import numpy as np

from edge_client import codecs
from edge_client.codecs import Encoded

#: The Failure reason of a device that does not hold a difference's base, or whose rebuilt model fails its hash.
MISMATCH = "model_mismatch"


class Downlink:
    """The published model of the round, the difference to it, and which model each device holds."""

    def __init__(self, codec: str, seed: int) -> None:
        self.spec = codecs.parse(codec)
        self.rng = np.random.default_rng(seed)
        self.published: np.ndarray | None = None
        self.sha256 = ""
        self.diff: Encoded | np.ndarray | None = None
        self.base = ""  # sha256 of the model ``diff`` applies to
        self.holds: dict[str, str] = {}  # client -> sha256 of the model it holds
        self._sent: dict[str, str] = {}  # client -> sha256 of the model it was sent this round

    @property
    def enabled(self) -> bool:
        return not self.spec.lossless

    def publish(self, weights: np.ndarray) -> None:
        """This round's model from the server's ``weights``, and the difference for holders of the last one."""
        if not self.enabled:
            self.published = weights
            return
        if self.published is None:
            self.diff, self.base, model = None, "", np.array(weights, np.float32)
        else:
            self.base = self.sha256
            self.diff, model = codecs.encode_model_diff(self.published, weights, self.spec, self.rng)
        self.published, self.sha256 = model, codecs.digest(model)
        self._sent = {}

    def model_for(self, client_id: str) -> tuple[np.ndarray | Encoded, str, str]:
        """``(weights, diff_base, model_sha256)`` of the client's assignment."""
        assert self.published is not None, "publish() first"
        if not self.enabled:
            return self.published, "", ""
        self._sent[client_id] = self.sha256
        if self.diff is not None and self.holds.get(client_id) == self.base:
            return self.diff, self.base, self.sha256
        return self.published, "", self.sha256

    def confirm(self, client_id: str) -> None:
        """The client's update of this round was admitted: it holds the model it was sent."""
        if client_id in self._sent:
            self.holds[client_id] = self._sent[client_id]

    def forget(self, client_id: str) -> None:
        """Send the client the full model next (it restarted, or could not use a difference)."""
        self.holds.pop(client_id, None)
