"""The fleet as the orchestrator sees it right now, recorded in ``RUN_DIR/live.json`` for the dashboard.

Per-round facts are in ``metrics.jsonl``; what only the orchestrator knows between rounds lives here: which clients
are online and when each was last heard from, the device facts of its hello, its rejected messages by reason, what it
was last told (local steps, alpha, lr) and the round in progress. The orchestrator's hooks only change a dict under a
lock; a writer thread serialises it and replaces the file atomically (tmp + ``os.replace``), at most
``1 / min_interval_s`` times a second. So the dashboard reads files alone (``edge-server dashboard --out RUN_DIR``
works without the server) and neither it nor a slow disk can hold up a round. Until :meth:`LiveState.start` nothing is
written (tests drive an orchestrator's handlers without running it).

What a device says is untrusted: its hello's facts are made JSON-safe (``json_safe``) before they are stored, the state
is serialised strictly (no NaN, which ``JSON.parse`` refuses and which stopped the page for everyone) with a sanitised
copy as the fallback, and the writer thread logs whatever goes wrong and carries on: one device's bytes cannot leave
``live.json`` at round 0.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

from server.config import RunConfig
from server.strict_json import json_safe, strict_json

log = logging.getLogger("edgefl.server")

LIVE_FILE = "live.json"
#: The instruction fields the dashboard shows (what a client was last told); the rest stays in metrics.jsonl.
TOLD_KEYS = ("local_steps", "lr", "batch_size")
#: The per-round values of a plan's settings it shows, by the name the page shows them under (TACO's alpha_i).
TOLD_VALUES = {"alpha_i": "alpha"}


def run_facts(config: RunConfig, dataset: str, target: float | None) -> dict[str, Any]:
    """The run facts the dashboard heads its page with: known from the configuration before the run starts, so the
    page shows them at once (``RunView``) and ``live.json`` repeats them."""
    return {"algorithm": config.train.algorithm, "dataset": dataset, "partition": config.data.partition,
            "job": config.run.job, "rounds": config.run.rounds, "target": target}  # fmt: skip


class LiveState:
    """Mutated by the orchestrator's thread, written by its own; every time is the server's ``time.time()``."""

    def __init__(self, out_dir: Path, run: dict[str, Any], min_interval_s: float = 0.25) -> None:
        self.path = Path(out_dir) / LIVE_FILE
        self.min_interval_s = min_interval_s
        self._state: dict[str, Any] = {
            "run": {
                **run,
                "round": 0,
                "round_started_at": None,
                "started_at": None,
                "elapsed_origin_at": None,
                "finished": False,
            },
            "clients": {},
            "unattributed_rejections": {},
            "updated_at": None,
        }
        self._cond = threading.Condition()
        self._dirty = False
        self._closing = False
        self._writer: threading.Thread | None = None

    # -- hooks (orchestrator thread) ---------------------------------------------------------------------------------
    def heard(self, client_id: str | None) -> None:
        """Any message from this client's topic (accepted or not)."""
        if client_id is not None:
            with self._cond:
                self._client(client_id)["last_seen"] = time.time()
                self._changed()

    def registered(self, client_id: str, device: dict[str, Any]) -> None:
        """``device``: the hello's facts, as the device sent them (made JSON-safe here)."""
        facts = json_safe(device) if isinstance(device, dict) else {}
        with self._cond:
            self._client(client_id).update(online=True, device=facts, registered_at=time.time())
            self._changed()

    def presence(self, client_id: str, online: bool) -> None:
        with self._cond:
            if client_id in self._state["clients"]:  # a presence before any hello registers nothing
                self._client(client_id)["online"] = online
                self._changed()

    def rejected(self, client_id: str | None, reason: str) -> None:
        with self._cond:
            counts = self._client(client_id)["rejected"] if client_id else self._state["unattributed_rejections"]
            counts[reason] = counts.get(reason, 0) + 1
            self._changed()

    def round_started(self, round_: int, elapsed_s: float, told: dict[str, dict[str, Any]]) -> None:
        """``elapsed_s``: the run's clock (metrics.jsonl's ``elapsed_s``) at this round's start; ``elapsed_origin_at``
        is where that clock reads zero, so the dashboard's elapsed time continues the metrics' own."""
        now = time.time()
        with self._cond:
            run = self._state["run"]
            run.update(round=round_, round_started_at=now, elapsed_origin_at=now - elapsed_s)
            for cid, instr in told.items():
                values = instr.get("settings", {})
                shown = {k: instr[k] for k in TOLD_KEYS if k in instr}
                shown |= {as_shown: values[name] for name, as_shown in TOLD_VALUES.items() if name in values}
                self._client(cid)["told"] = {"round": round_, **shown}
            self._changed()

    # -- lifetime ----------------------------------------------------------------------------------------------------
    def start(self) -> None:
        """Write the state now and from here on whenever it changes."""
        with self._cond:
            self._state["run"]["started_at"] = time.time()
            self._changed()
        self._writer = threading.Thread(target=self._write_loop, name="edgefl-live-state", daemon=True)
        self._writer.start()

    def close(self) -> None:
        """Mark the run finished, write it, stop the writer."""
        with self._cond:
            self._state["run"]["finished"] = True
            self._closing = True
            self._changed()
        if self._writer is not None:
            self._writer.join()

    # -- internals ---------------------------------------------------------------------------------------------------
    def _client(self, client_id: str) -> dict[str, Any]:
        clients = self._state["clients"]
        if client_id not in clients:
            clients[client_id] = {"online": False, "last_seen": None, "device": {}, "rejected": {}, "told": None}
        return clients[client_id]

    def _changed(self) -> None:
        self._dirty = True
        self._cond.notify()

    def _write_loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._dirty)
                self._state["updated_at"] = time.time()
                self._dirty, closing = False, self._closing
                try:
                    text: str | None = strict_json(self._state)
                except Exception:  # the dashboard goes stale for one write; the writer and training go on
                    log.exception("could not serialise the live state; %s not updated this time", self.path)
                    text = None
            if text is not None:
                self._write(text)
            if closing:
                return
            with self._cond:  # the throttle: changes in the meantime go out together
                self._cond.wait_for(lambda: self._closing, timeout=self.min_interval_s)

    def _write(self, text: str) -> None:
        tmp = self.path.with_suffix(".tmp")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(text)
            os.replace(tmp, self.path)
        except OSError as exc:  # the dashboard goes stale; training goes on
            log.warning("could not write %s: %s", self.path, exc)
