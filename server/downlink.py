"""The round model devices are sent: the model itself, or (``train.downlink_codec = "int8"``) the int8-coded
difference from the previous round's model, which every device that holds that model rebuilds the new one from.

A lossy difference means the model devices train from, the *published* model ``m_t``, is not exactly the round's start
model ``w_t``: ``m_t = m_{t-1} + Q(w_t - m_{t-1})``. Every device of a round trains from the same ``m_t``, named by
its digest, which a device checks after applying a difference; one that cannot (it lacks ``m_{t-1}``, or the check
fails) asks for ``m_t`` itself (``server.distribution``). What ``Q`` left out stays in ``w_t - m_t`` and is part of
the next difference (error feedback on the server), so it is never lost; the server keeps aggregating, evaluating and
checkpointing ``w_t``. Only the weights travel as a difference: the arrays every client shares (SCAFFOLD's c, ...)
go as they are. A resumed server starts with the full model.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from edge_client.wire import codecs
from edge_client.wire.messages import GlobalModel, model_digest, new_msg_id


class Downlink:
    """The published model of the round and the message that carries it to every device."""

    def __init__(self, codec: str, seed: int) -> None:
        self.spec = codecs.parse(codec)
        self.rng = np.random.default_rng(seed)
        self.published: GlobalModel | None = None  # m_t, as devices rebuild it
        self.message: GlobalModel | None = None  # what carries m_t to a device holding m_{t-1}
        self._source = ""  # digest of the start model ``published`` was made from

    def publish(self, start: GlobalModel) -> tuple[GlobalModel, GlobalModel]:
        """The round's model as devices will hold it, and its broadcast (the difference when there is a base).

        A start model already published (the same version again) gives the same pair: devices hold it already.
        """
        if self.spec.lossless:
            return start, start
        if start.sha256 == self._source and self.published is not None and self.message is not None:
            return self.published, self.message
        previous = self.published
        if previous is None or previous.weights.shape != start.weights.shape:
            model = dataclasses.replace(start, weights=np.array(start.weights, np.float32))
            message = model
        else:
            diff, rebuilt = codecs.encode_model_diff(previous.weights, start.weights, self.spec, self.rng)
            model = dataclasses.replace(start, weights=rebuilt, sha256=model_digest(rebuilt, start.arrays))
            message = dataclasses.replace(model, weights=diff, diff_base=previous.sha256, msg_id=new_msg_id())
        self.published, self.message, self._source = model, message, start.sha256
        return model, message
