"""Fetch the server's newest exported ONNX model from the broker (retained on the job's model topic)."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from edge_client.wire.messages import ModelFile
from edge_client.wire.topics import Topics
from edge_client.wire.transport import LinkConfig, MqttLink


def fetch_model(config: LinkConfig, client_id: str, out: Path, *, job: str = "default", timeout: float = 30.0) -> dict:
    """Write the model to ``out`` and its sidecar to ``<out>.json`` (the Predictor reads both); return the sidecar.

    Raises TimeoutError when the server has not published a model yet, ValueError when the bytes do not match the
    digest the server sent.
    """
    topics = Topics(job)
    link = MqttLink(config, f"edgefl-{job}-{client_id}-fetch", [topics.model]).start()
    try:
        received = link.receive(timeout)
    finally:
        link.stop()
    if received is None or not isinstance(received[1], ModelFile):
        raise TimeoutError(f"no model on {topics.model} within {timeout:.0f} s: has the server finished a round yet?")
    model = received[1]
    data = bytes(model.data)
    if hashlib.sha256(data).hexdigest() != model.sha256:
        raise ValueError(f"the model on {topics.model} does not match its sha256; not written")
    meta: dict[str, Any] = {**model.meta, "sha256": model.sha256, "round": model.round}
    out.parent.mkdir(parents=True, exist_ok=True)
    for path, content in ((out, data), (Path(f"{out}.json"), json.dumps(meta, indent=2).encode())):
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_bytes(content)
        os.replace(tmp, path)
    return meta
