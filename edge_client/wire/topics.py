"""Topic scheme: one topic per client and direction, so the broker ACL can confine each device to its own topics."""

from __future__ import annotations

import re
from dataclasses import dataclass

# Client ids become topic levels and broker usernames: no '/', '+', '#', spaces or leading punctuation.
# Match with fullmatch (or validate_client_id): `$` alone would also accept a trailing newline.
CLIENT_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


def validate_client_id(client_id: str, *, what: str = "client id") -> str:
    """Return ``client_id`` if it is safe as a topic level and username, else raise ValueError saying the rule."""
    if not isinstance(client_id, str) or CLIENT_ID_RE.fullmatch(client_id) is None:
        raise ValueError(
            f"invalid {what} {client_id!r}: expected 1-64 characters matching {CLIENT_ID_RE.pattern} "
            "(letters, digits, '_', '.', '-'; starting with a letter or digit)"
        )
    return client_id


def stream_of(topic: str) -> str:
    """The stream a received frame belongs to: a job's round model for its per-frame topics, else the topic itself
    (frames are reassembled and counted per stream)."""
    head, _, index = topic.rpartition("/")
    parts = head.split("/")
    if index.isdigit() and len(parts) == 4 and parts[0] == "edgefl" and parts[2:] == ["model", "global"]:
        return head
    return topic


@dataclass(frozen=True)
class Topics:
    """The topics of one job (``edgefl/<job>/...``); several jobs can share a broker."""

    job: str = "default"

    def __post_init__(self) -> None:
        validate_client_id(self.job, what="job name")

    @property
    def root(self) -> str:
        return f"edgefl/{self.job}"

    def up(self, client_id: str) -> str:
        """Client -> server: hello, update, presence (last will)."""
        return f"{self.root}/c/{validate_client_id(client_id)}/up"

    def down(self, client_id: str) -> str:
        """Server -> that client only: assignment, stop."""
        return f"{self.root}/c/{validate_client_id(client_id)}/down"

    @property
    def broadcast(self) -> str:
        return f"{self.root}/broadcast"

    @property
    def server(self) -> str:
        """Retained server presence; clients say hello again when it comes online."""
        return f"{self.root}/server"

    @property
    def model(self) -> str:
        """Retained: the newest exported ONNX model, for devices to fetch."""
        return f"{self.root}/model"

    @property
    def round_model(self) -> str:
        """Server -> every device: the round's GlobalModel, frame ``i`` of it on ``<this>/<i>`` (retained per frame,
        so a broker can keep a chunked model whole); the stream its frames are reassembled and counted under."""
        return f"{self.root}/model/global"

    def round_model_frame(self, index: int) -> str:
        return f"{self.round_model}/{index}"

    @property
    def round_model_frames(self) -> str:
        """The filter a device subscribes to (``model`` itself, the ONNX export, is not matched by it)."""
        return f"{self.round_model}/+"

    @property
    def all_up(self) -> str:
        return f"{self.root}/c/+/up"

    def sender_of(self, topic: str) -> str | None:
        """Client id of an ``up`` topic of this job, else None (the server trusts the topic, which the ACL guards)."""
        parts = topic.split("/") if isinstance(topic, str) else []
        if len(parts) != 5 or parts[:3] != ["edgefl", self.job, "c"] or parts[4] != "up":
            return None
        return parts[3] if CLIENT_ID_RE.fullmatch(parts[3]) else None
