"""The roster: which devices are registered, online or refused, and the server's own presence they register against.

A device registers with a hello that states the model it holds (its parameter layout's fingerprint); one whose layout
is not the server's is refused and told which parameter differs, and one that states no model (it has not seen the
server's retained presence, e.g. on another cluster node) is sent that presence on its own topic, at most every
``PRESENCE_REPLY_S`` per device, so a device answering every presence with a bare hello is no loop. A device refused
at registration while it serves a round stays known, refused and offline, until that round closes, so no lookup of
the round loses it. The roster is kept apart from the round loop so that any loop (rounds, buffered) registers devices
the same way, waits for them the same way, and ends a run the same way: every device told to stop (``Stop``), the
server's presence offline, retained (also its link's last will, ``server_link``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from edge_client.learning.models import build_model, fingerprint, layout_difference, parameter_layout
from edge_client.wire.messages import Hello, Presence, Refusal, Stop
from edge_client.wire.protocol import InvalidField, encode
from edge_client.wire.topics import Topics
from edge_client.wire.transport import Link, LinkConfig, MqttLink
from server.admission import RoundState, WrongSampleCount
from server.live_state import LiveState

log = logging.getLogger("edgefl.server")
PRESENCE_REPLY_S = 10.0  # the least time between two presences sent to one device that registers without its model


def server_offline(reason: str, run_id: str = "") -> Presence:
    """The server's presence when it is gone: its last will (no run yet) or its goodbye at the end of a run."""
    return Presence(client_id="server", online=False, role="server", reason=reason, run_id=run_id)


def server_link(config: LinkConfig, topics: Topics, spool_dir: Path, on_connect: Callable[[], None]) -> MqttLink:
    """The server's connection: every device's uplink, the server's presence "offline" as its last will, and
    ``on_connect`` (``Roster.announce``) on every (re)connect; the updates that arrive at once wait in ``spool_dir``,
    not in memory. An injected link (in-process) has no such hook: the loop announces once it starts it."""
    will = (topics.server, encode(server_offline("connection lost")), True)
    return MqttLink(config, f"edgefl-server-{topics.job}", [topics.all_up], will=will, on_connect=on_connect,
                    spool_dir=spool_dir)  # fmt: skip


@dataclass
class ClientRecord:
    client_id: str
    num_samples: int
    device: dict[str, Any] = field(default_factory=dict)
    online: bool = True
    eval_samples: int = 0  # the held-out split it evaluates on
    refused: str = ""  # why its last hello was refused: kept, offline, until the round it is part of closes


class ModelMismatch(InvalidField):
    """A device whose model's parameter layout is not the server's: refused at registration."""

    reason = "model"


class Roster:
    """The registered devices and the server's presence (its model, fingerprint and run id) they register against."""

    def __init__(self, link: Link, topics: Topics, model_spec: dict[str, Any], live: LiveState, max_samples: int
                 ) -> None:  # fmt: skip
        self.link = link
        self.topics = topics
        self.model_spec = model_spec
        self.live = live
        self.max_samples = max_samples  # clients.max_samples: the most samples a device may register with
        self.layout = parameter_layout(build_model(model_spec))
        self.fingerprint = fingerprint(self.layout)
        self.run_id = ""  # set once the run starts or resumes: devices learn it from the server's presence
        self.clients: dict[str, ClientRecord] = {}
        self.client_samples: dict[str, int] = {}  # shared with the strategy's context
        self._presence_sent: dict[str, float] = {}  # when each device was last sent the presence on its own topic

    # -- the server's presence ---------------------------------------------------------------------------------------
    def server_presence(self) -> Presence:
        """Online, with the run id and the model devices must state at registration."""
        return Presence(
            "server", True, "server", model=self.model_spec, fingerprint=self.fingerprint, run_id=self.run_id
        )

    def announce(self) -> None:
        """Online, retained: on every (re)connect, so the last will's retained 'offline' never outlives a reconnect
        and devices learn the current run (and send again what this server may have lost)."""
        self.link.publish(self.topics.server, encode(self.server_presence()), retain=True)

    def goodbye(self, stopped: BaseException | None) -> None:
        """The end of the run: every device is told to stop and why (finished, or ``stopped`` by Ctrl-C, kill or an
        error), and the server's presence goes offline, retained; both are waited for (up to 5 s)."""
        reason = "training finished" if stopped is None else f"interrupted ({stopped or type(stopped).__name__})"
        self.link.publish(self.topics.broadcast, encode(Stop(reason=reason[:200], run_id=self.run_id)))
        self.link.publish(self.topics.server, encode(server_offline("stopped", self.run_id)), retain=True)
        self.link.wait_published(timeout=5.0)

    # -- devices -----------------------------------------------------------------------------------------------------
    def register(self, sender: str, hello: Hello, state: RoundState | None) -> None:
        """Register ``sender`` (again); ``state`` is the round in progress, where a refused device stays known."""
        if hello.client_id != sender:
            raise InvalidField(f"hello on the topic of {sender!r} claims client id {hello.client_id!r}")
        limit = self.max_samples
        for what, count in (("training", hello.num_samples), ("held-out", hello.eval_samples)):
            if count > limit:
                raise WrongSampleCount(
                    f"{sender} registers with {count} {what} samples, more than clients.max_samples ({limit}); "
                    "not registered"
                )
        self._check_model(sender, hello, state)
        known = self.clients.get(sender)
        self.clients[sender] = ClientRecord(sender, hello.num_samples, hello.device, True, hello.eval_samples)
        self.client_samples[sender] = hello.num_samples
        self.live.registered(sender, hello.device)
        if known is None or not known.online:
            log.info(
                "client %s registered: %d samples, %s",
                sender,
                hello.num_samples,
                {k: hello.device.get(k) for k in ("hostname", "machine", "cpu_count", "device_class")},
            )

    def _check_model(self, sender: str, hello: Hello, state: RoundState | None) -> None:
        """Refuse a device whose model is not the server's, and tell it which parameter differs."""
        stated = hello.model
        if not stated:  # it has not seen the server's presence: send it, at most every PRESENCE_REPLY_S per device
            now = time.monotonic()
            if now - self._presence_sent.get(sender, -PRESENCE_REPLY_S) >= PRESENCE_REPLY_S:
                self._presence_sent[sender] = now
                log.info("client %s registers without stating its model; sending it the server's presence", sender)
                self.link.publish(self.topics.down(sender), encode(self.server_presence()))
            return
        if stated.get("digest") == self.fingerprint:
            return
        if "error" in stated:
            detail = f"the device cannot build the model {self.model_spec}: {str(stated['error'])[:1000]}"
        else:
            detail = f"its model differs from the server's: {layout_difference(self.layout, stated.get('layout'))}"
        refusal = Refusal(sender, "model", detail[:2000])
        self.link.publish(self.topics.down(sender), encode(refusal))
        self._refuse(sender, "model", state)
        raise ModelMismatch(f"{sender} refused at registration: {detail}")

    def _refuse(self, sender: str, reason: str, state: RoundState | None) -> None:
        """Forget a refused device, or, while a round it was told to serve is open, keep it known but refused and
        offline (not waited for, its update refused) so that every lookup of the round still finds it."""
        record = self.clients.get(sender)
        if record is None:
            return
        if state is None or sender not in state.assigned_steps:
            self.clients.pop(sender)
            self.client_samples.pop(sender, None)
            return
        record.online, record.refused = False, reason
        if sender not in state.received:
            state.failed.setdefault(sender, f"refused: {reason}")
        self.live.presence(sender, False)

    def known(self, sender: str) -> ClientRecord | None:
        """The record of a registered device that was not refused since."""
        record = self.clients.get(sender)
        return None if record is None or record.refused else record

    def forget_refused(self) -> None:
        """Once the round they were part of closed, the refused devices are forgotten."""
        for cid in [c for c, record in self.clients.items() if record.refused]:
            del self.clients[cid]
            self.client_samples.pop(cid, None)

    def presence(self, sender: str, presence: Presence) -> None:
        """A device's own presence (its last will, or back online)."""
        if presence.client_id != sender:
            raise InvalidField(f"presence on the topic of {sender!r} claims client id {presence.client_id!r}")
        record = self.known(sender)  # a refused device stays offline whatever it says
        if record is not None and record.online != presence.online:
            record.online = presence.online
            self.live.presence(sender, presence.online)
            log.info("client %s is %s (%s)", sender, "online" if presence.online else "offline", presence.reason)

    def online(self) -> list[str]:
        return sorted(c for c, rec in self.clients.items() if rec.online)

    def wait_for(self, count: int, timeout_s: float, pump: Callable[[float], None], waiting: Callable[[str], None]
                 ) -> None:  # fmt: skip
        """Handle messages (``pump``) until ``count`` devices are online, saying so (``waiting``); TimeoutError after
        ``timeout_s`` (``clients.register_timeout_s``)."""
        deadline = time.monotonic() + timeout_s
        while len(self.online()) < count:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"only {len(self.online())} of {count} clients registered within {timeout_s:.0f} s "
                    f"({self.online()}); start more clients or lower clients.min_clients"
                )
            waiting(f"waiting for clients: {len(self.online())}/{count} registered")
            pump(0.5)

    def samples(self, devices: Iterable[str]) -> dict[str, int]:
        """The training samples each of ``devices`` registered with."""
        return {c: self.clients[c].num_samples for c in devices}

    def is_online(self, cid: str) -> bool:
        """Whether ``cid`` is registered and online (a refused or forgotten device is not)."""
        record = self.clients.get(cid)
        return record is not None and record.online
