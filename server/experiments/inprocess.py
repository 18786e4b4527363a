"""In-process execution: the same server and device code, with the clients run one after another in this process.

What crosses the "network" is exactly what would cross MQTT: encoded messages, routed by topic filter, decoded and
validated by each side's ``Inbox``. Only the transport and the scheduling differ: when the server waits for a
message, the next client with work pending runs to completion on the server's thread. So a sweep needs no broker and
no processes, and every client's compute time is measured with the machine to itself (no two clients share the
cores), which is what the papers' time-to-accuracy figures assume.

With one torch thread and the same seed, a run gives the same accuracy as the same run over a broker with one
process per client (tests/integration/test_inprocess.py checks this to 1e-4 after three rounds).

Beside the real wall clock, a run keeps the parallel clock (``server.fleet_summary``): each round as long as its
slowest device, the time a fleet would take. With a fleet of device profiles (``[fleet]``, ``--fleet``), each client's
measured compute is divided by its profile's CPU share and its transfers take its link rates; without one, every
client is a core of this machine and transfers are not modelled. No deadline applies in-process.
"""

from __future__ import annotations

import dataclasses
import heapq
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from paho.mqtt.client import topic_matches_sub

from edge_client.learning.data import load_local_data, split_holdout
from edge_client.learning.factories import AllowedCode, factory_modules
from edge_client.loop.runtime import EdgeClient
from edge_client.loop.trainer import prepare_process
from edge_client.wire.messages import Message
from edge_client.wire.topics import Topics
from edge_client.wire.transport import Inbox, LinkConfig
from server.assembly import make_orchestrator
from server.config import RunConfig
from server.datasets import DatasetBundle
from server.deadlines import DeviceTimes
from server.experiments.attacks import behaviour
from server.experiments.fleet import DeviceFacts, Fleet, fleet_of, slowed
from server.experiments.simulate import behaviours, client_ids, client_state_dirs, roles_summary
from server.orchestrator import RoundObserver
from server.target import simulated_holdout

log = logging.getLogger("edgefl.inprocess")

#: A round never times out in-process: clients run one after another, so the wall clock of a round is the sum of
#: their compute, and a deadline sized for parallel devices would cut the last ones off.
NO_DEADLINE_S = 1e9


class LocalBus:
    """Routes published frames to every other attached link whose subscriptions match, keeping retained ones.

    Thousands of simulated devices (a differential-privacy population) must not cost a scan of every link per frame:
    links are indexed by subscription, exact topics in a dict and the few wildcard filters (the same for every client)
    matched once each, and the clients with frames waiting are kept in a heap of their positions, served in the order
    a scan of the clients would serve them."""

    def __init__(self) -> None:
        self.links: list[LocalLink] = []
        self.retained: dict[str, bytes] = {}
        self.clients: list[tuple[EdgeClient, LocalLink]] = []
        self._exact: dict[str, list[LocalLink]] = {}  # topic filter without wildcards -> its subscribers
        self._wildcard: dict[str, list[LocalLink]] = {}  # filter with + or # -> its subscribers
        self._waiting: list[int] = []  # heap of positions in ``clients`` that were sent a frame
        self._queued: set[int] = set()

    def _index(self, link: LocalLink) -> list[list[LocalLink]]:
        return [
            (self._wildcard if "+" in sub or "#" in sub else self._exact).setdefault(sub, [])
            for sub in link.subscriptions
        ]

    def attach(self, link: LocalLink) -> None:
        self.links.append(link)
        for subscribers in self._index(link):
            subscribers.append(link)

    def detach(self, link: LocalLink) -> None:
        if link in self.links:
            self.links.remove(link)
            for subscribers in self._index(link):
                subscribers.remove(link)

    def deliver(self, sender: LocalLink, topic: str, payload: bytes, retain: bool) -> None:
        if retain and payload:
            self.retained[topic] = payload
        elif retain:  # an empty retained message clears the topic, as on a broker
            self.retained.pop(topic, None)
        groups = [self._exact.get(topic, [])]
        groups += [links for sub, links in self._wildcard.items() if topic_matches_sub(sub, topic)]
        receivers = {id(link): link for links in groups for link in links if link is not sender}  # once each
        for link in receivers.values():
            link.put(topic, payload)

    def sent(self, position: int) -> None:
        """Client ``position`` was sent a frame: it is among those ``run_next_client`` serves."""
        if position not in self._queued:
            self._queued.add(position)
            heapq.heappush(self._waiting, position)

    def connect(self, subscriptions: list[str], on_connect: Callable[[], None]) -> LocalLink:
        """An EdgeClient's ``link_factory``."""
        return LocalLink(self, subscriptions, on_connect=on_connect)

    def add_client(self, client: EdgeClient) -> None:
        """Attach a client built with ``link_factory=bus.connect``; it says hello as it would on connecting."""
        if not isinstance(client.link, LocalLink):
            raise TypeError(f"client {client.client_id} was not built with link_factory=bus.connect")
        client.link.position = len(self.clients)
        self.clients.append((client, client.link))
        client.link.start()

    def run_next_client(self) -> bool:
        """Let the first client with messages waiting handle all of them; False when no client had any."""
        while self._waiting:
            position = heapq.heappop(self._waiting)
            self._queued.discard(position)
            client, link = self.clients[position]
            if link.pending():
                while (received := link.receive(0)) is not None:
                    client.handle(received[1])
                return True
        return False


class LocalLink(Inbox):
    """A ``Link`` on a ``LocalBus``: publishing delivers at once, and the server's ``receive`` runs waiting clients."""

    session_present = True  # a bus loses nothing

    def __init__(
        self,
        bus: LocalBus,
        subscriptions: list[str],
        *,
        drives_clients: bool = False,
        on_connect: Callable[[], None] | None = None,
    ) -> None:
        super().__init__(LinkConfig.max_message_bytes)
        self.bus = bus
        self.subscriptions = subscriptions
        self.drives_clients = drives_clients
        self._on_connect = on_connect
        self.position: int | None = None  # its client's place on the bus (``LocalBus.add_client``)

    def subscribed(self, topic: str) -> bool:
        return any(topic_matches_sub(sub, topic) for sub in self.subscriptions)

    def put(self, topic: str, payload: bytes) -> None:
        self._offer(topic, payload)
        if self.position is not None:
            self.bus.sent(self.position)

    def pending(self) -> bool:
        return not self._inbox.empty()

    def start(self) -> LocalLink:
        self.bus.attach(self)
        for topic, payload in self.bus.retained.items():
            if self.subscribed(topic):
                self.put(topic, payload)
        if self._on_connect:
            self._on_connect()
        return self

    def stop(self) -> None:
        self.bus.detach(self)

    def publish(self, topic: str, payload: bytes | bytearray, *, retain: bool = False, chunked: bool = True) -> int:
        self.bus.deliver(self, topic, bytes(payload), retain)
        return len(payload)

    def wait_published(self, timeout: float) -> bool:
        return True

    def chunk_size(self) -> int:
        """What an MQTT link uses by default, so that big messages travel as the same chunk frames."""
        return LinkConfig.chunk_size

    def receive(self, timeout: float) -> tuple[str, Message] | None:
        """Never waits: when nothing is queued, the next client with work runs first; None once nobody has any."""
        received = super().receive(0)
        while received is None and self.drives_clients and self.bus.run_next_client():
            received = super().receive(0)
        return received


def run_inprocess(
    config: RunConfig,
    shards: list[Path],
    bundle: DatasetBundle,
    out_dir: Path,
    *,
    root: Any = None,
    observer: RoundObserver | None = None,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One EdgeClient per shard on one bus, the server here; returns the run's summary.

    Clients load the same .npz shards the processes of ``simulate`` load, so both modes train on identical arrays.
    """
    clients = dataclasses.replace(config.clients, round_deadline_s=NO_DEADLINE_S, deadline_factor=0.0)
    config = dataclasses.replace(config, clients=clients)
    prepare_process(config.simulation.threads)
    roles = behaviours(config)
    bus = LocalBus()
    ids = client_ids(config.clients.count)
    fleet = fleet_of(config, ids)
    profiles = fleet.by_client if fleet else {}
    state_dirs = client_state_dirs(out_dir, ids)
    share = simulated_holdout(config)
    for cid, shard in zip(ids, shards, strict=True):
        train = behaviour(roles[cid], cid)
        facts = DeviceFacts(profiles[cid]) if cid in profiles else None
        data, holdout = load_local_data(shard), None
        if share:  # as edge-client run --holdout with --holdout-seed = the run's seed
            data, holdout = split_holdout(data, share, config.run.seed, cid)
        client = EdgeClient(
            cid,
            data,
            None,
            job=config.run.job,
            threads=config.simulation.threads,
            state_dir=state_dirs[cid],
            link_factory=bus.connect,
            train=slowed(train, profiles[cid], facts) if facts else train,
            device_class=profiles[cid].name if cid in profiles else None,
            **({"snapshot": facts.snapshot} if facts else {}),
            holdout=holdout,
            allowed=AllowedCode(packages=factory_modules(config.model, config.task)),  # the run's own code
            model_wait_s=0.0,  # nothing is in flight in-process: a model not here at its assignment was missed
        )
        bus.add_client(client)
    orchestrator = make_orchestrator(
        config,
        bundle,
        out_dir,
        link=LocalLink(bus, [Topics(config.run.job).all_up], drives_clients=True),
        root=root,
        observer=observer,
        extra={"mode": "inprocess", **roles_summary(config), **(fleet_extra(fleet) if fleet else {}), **(extra or {})},
        times=DeviceTimes(links=profiles),
    )
    return orchestrator.run()


def fleet_extra(fleet: Fleet) -> dict[str, Any]:
    """summary.json's account of an in-process fleet."""
    how = "in-process: each client's compute measured alone here and divided by its profile's CPU share"
    return {"fleet": {**fleet.describe(), "cpu_limits": how}}
