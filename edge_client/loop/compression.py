"""What a device does with codecs (``edge_client.wire.codecs``): each uploaded array sent with the codec its round's
facts and its algorithm's contract allow, top-k residuals carried into the next upload (error feedback, kept across
restarts). Model differences the server broadcasts are applied where models are kept
(``edge_client.loop.models_cache``)."""

from __future__ import annotations

import zlib

import numpy as np

from edge_client.algorithms.base import ClientAlgorithm
from edge_client.algorithms.contract import UPDATE_DELTA
from edge_client.wire import codecs
from edge_client.wire.codecs import Encoded
from edge_client.wire.messages import RoundFacts


class Uplink:
    """Encodes a round's upload. ``residuals`` hold, per array, what a top-k codec did not send; they belong to one
    run (a new run id starts from none) and are added to that array's next upload, whatever its codec."""

    def __init__(self, client_id: str) -> None:
        self.client_id = client_id
        self.run_id = ""
        self.residuals: dict[str, np.ndarray] = {}
        self._kept = False  # residuals were kept once: the saved state must be rewritten even when none are left

    def encode(
        self, facts: RoundFacts, algorithm: ClientAlgorithm, delta: np.ndarray, arrays: dict[str, np.ndarray]
    ) -> tuple[np.ndarray | Encoded, dict[str, np.ndarray | Encoded]]:
        """``delta`` and ``arrays`` as they go on the wire; ValueError (residuals untouched) when one cannot be coded.

        ``commit`` arrays are handed back to ``algorithm.uploaded`` as the server will decode them.
        """
        spec = codecs.parse(facts.codec)
        if facts.run_id != self.run_id:
            self.run_id, self.residuals = facts.run_id, {}
        # stochastic rounding: unbiased with any seed; this one makes a run reproducible
        rng = np.random.default_rng([facts.seed, facts.round, zlib.crc32(self.client_id.encode())])
        residuals = dict(self.residuals)
        out: dict[str, np.ndarray | Encoded] = {}
        committed: dict[str, np.ndarray] = {}
        for name, x in {UPDATE_DELTA.name: delta, **arrays}.items():
            rule = algorithm.contract.codec_rule(name)
            array_spec = spec.for_rule(rule)
            kept = residuals.pop(name, None)
            if rule == "feedback" and kept is not None and kept.shape == x.shape:
                x = x + kept
            encoded = out[name] = codecs.encode(x, array_spec, rng)
            sent = encoded if isinstance(encoded, np.ndarray) else codecs.decode(encoded)
            if rule == "feedback" and array_spec.kind == "topk":
                residuals[name] = (x - sent).astype(np.float32)
            elif rule == "commit":
                committed[name] = sent
        self.residuals = residuals
        self._kept = self._kept or bool(residuals)
        if committed and not spec.lossless:
            algorithm.uploaded(committed)
        return out.pop(UPDATE_DELTA.name), out

    def state_dict(self) -> dict[str, np.ndarray]:
        if not self._kept:
            return {}
        return {"run_id": np.array(self.run_id), **{f"residual:{k}": v for k, v in self.residuals.items()}}

    def load_state_dict(self, state: dict[str, np.ndarray]) -> None:
        self.run_id, self._kept = str(state.get("run_id", "")), True
        self.residuals = {
            k.removeprefix("residual:"): np.asarray(v, np.float32) for k, v in state.items() if k != "run_id"
        }
