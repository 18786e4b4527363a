"""A whole federation on one machine: a broker, the server, and N real `edge-client` processes.

The clients talk to the server only through the broker, exactly as devices would; each gets its shard of the data
set as an .npz file, its own broker credentials (through the environment, never the command line) and a fixed
number of torch threads so that two cores are shared predictably. With a fleet of device profiles (``[fleet]``,
``--fleet``) each process says its class and runs in a cgroup of its own with its class's CPU quota
(``server.experiments.cgroups``), so its compute takes what that device would spend.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from edge_client.learning.factories import factory_modules
from edge_client.loop.device import EMULATED_ENV
from edge_client.wire.transport import LinkConfig
from server.assembly import make_orchestrator
from server.checkpoint import resumes
from server.config import RunConfig
from server.datasets import DatasetBundle
from server.experiments.cgroups import CpuLimits
from server.experiments.fleet import EMULATED_THROTTLED, Fleet, fleet_of
from server.experiments.shards import format_histograms, label_histograms, partition_bundle, write_shards
from server.orchestrator import RoundObserver
from server.target import simulated_holdout

log = logging.getLogger("edgefl.simulate")


@dataclass
class ClientLogin:
    username: str
    password: str


def client_ids(count: int) -> list[str]:
    return [f"client-{i:02d}" for i in range(count)]


def prepare_shards(
    bundle: DatasetBundle, ids: list[str], scheme: str, seed: int, shard_dir: Path
) -> tuple[list[Path], str]:
    """Partition the training set, write ``<id>.npz`` per client and the label histograms beside them (sample
    counts alone for regression targets, which have no classes to count)."""
    parts = partition_bundle(bundle, len(ids), scheme, seed)
    shards = write_shards(bundle.train, parts, shard_dir, ids)
    if np.issubdtype(bundle.train.y.dtype, np.integer):
        table = format_histograms(label_histograms(bundle.train.y, parts, bundle.num_classes), ids)
    else:
        table = "\n".join(f"{cid} {len(part)} samples" for cid, part in zip(ids, parts, strict=True))
    (shard_dir / "label_histograms.txt").write_text(table + "\n")
    return shards, table


def behaviours(config: RunConfig) -> dict[str, str]:
    """Which simulated clients misbehave: freeloaders are the last ids, scaling attackers the ones before them."""
    ids = client_ids(config.clients.count)
    n_free = round(config.simulation.freeloaders * len(ids))
    n_att = round(config.simulation.attackers * len(ids))
    if n_free + n_att > len(ids):
        raise ValueError("simulation.freeloaders + simulation.attackers must not exceed 1")
    out = dict.fromkeys(ids, "honest")
    for cid in ids[len(ids) - n_free :] if n_free else []:
        out[cid] = "freeloader"
    for cid in ids[len(ids) - n_free - n_att : len(ids) - n_free] if n_att else []:
        out[cid] = f"scale:{config.simulation.attack_sigma}"
    return out


def roles_summary(config: RunConfig) -> dict[str, list[str]]:
    """Who misbehaves, for summary.json: what freeloader detection and robustness are judged against."""
    roles = behaviours(config)
    return {
        "freeloaders": [c for c, r in roles.items() if r == "freeloader"],
        "attackers": [c for c, r in roles.items() if r.startswith("scale:")],
    }


def client_state_dirs(out_dir: Path, client_ids: list[str]) -> dict[str, Path]:
    """Where simulated clients keep their algorithm state (SCAFFOLD's c_i, FedUmf's stored update) across restarts.

    A fresh run in a directory that held a finished one must not inherit the old run's state: it is removed then.
    """
    fresh = not resumes(out_dir)
    paths = {cid: out_dir / "clients" / f"{cid}.state" for cid in client_ids}
    for path in paths.values():
        if fresh and path.exists():
            shutil.rmtree(path)
    return paths


def user_code(config: RunConfig) -> tuple[list[str], dict[str, str]]:
    """The flags and environment with which a simulated device imports the run's own model and task factories: it
    may import exactly their modules (``--model-package``), found where the server found them (``PYTHONPATH``)."""
    modules = factory_modules(config.model, config.task)
    if not modules:
        return [], {}
    places = []
    for name in modules:
        spec = importlib.util.find_spec(name)  # the server imported it already (its config was checked)
        if spec is not None and spec.origin:
            place = Path(spec.origin).parent
            places.append(str(place.parent if spec.submodule_search_locations else place))
    path = os.pathsep.join(dict.fromkeys([*places, *filter(None, [os.environ.get("PYTHONPATH")])]))
    return [arg for name in modules for arg in ("--model-package", name)], {"PYTHONPATH": path}


def start_clients(
    config: RunConfig,
    url: str | dict[str, str],
    logins: dict[str, ClientLogin],
    shards: list[Path],
    out_dir: Path,
    ca_file: str | None = None,
    limits: CpuLimits | None = None,
    *,
    once: bool = True,
) -> dict[str, subprocess.Popen]:
    """One ``edge-client`` process per shard; logs and algorithm state under ``out_dir/clients``.

    ``url``: the broker of every client, or each client's own (devices of bridged sites, nodes of a cluster);
    ``limits``: the fleet's cgroups, each process is put in its own as soon as it started; ``once``: each exits when
    the run ends (a simulation); else they stay for the next run, as devices do.
    """
    log_dir = out_dir / "clients"
    log_dir.mkdir(parents=True, exist_ok=True)
    procs: dict[str, subprocess.Popen] = {}
    threads = str(config.simulation.threads)
    roles = behaviours(config)
    ids = client_ids(config.clients.count)
    fleet = fleet_of(config, ids)
    state_dirs = client_state_dirs(out_dir, ids)
    code_flags, code_env = user_code(config)
    holdout = simulated_holdout(config)
    for cid, shard in zip(ids, shards, strict=True):
        login = logins[cid]
        # a dishonest client is the device's own command line with its training wrapped (attacks.py)
        entry = ["edge_client.cli"] if roles[cid] == "honest" else ["server.experiments.attacks", roles[cid]]
        cmd = [
            sys.executable,
            "-m",
            *entry,
            "run",
            "--broker",
            url if isinstance(url, str) else url[cid],
            "--client-id",
            cid,
            "--username",
            login.username,
            "--data",
            str(shard),
            "--job",
            config.run.job,
            "--threads",
            threads,
            "--chunk-size",
            str(config.broker.chunk_size),
            "--state-dir",
            str(state_dirs[cid]),
            *(["--once"] if once else []),
        ]
        if ca_file:
            cmd += ["--ca-file", ca_file]
        if holdout:
            cmd += ["--holdout", str(holdout), "--holdout-seed", str(config.run.seed)]
        if config.broker.max_packet_size:
            cmd += ["--max-packet-size", str(config.broker.max_packet_size)]
        if fleet:
            cmd += ["--device-class", fleet.by_client[cid].name]
        throttles = fleet is not None and fleet.by_client[cid].throttle_from_round > 0
        cmd += code_flags
        env = {
            **os.environ,
            **code_env,
            "EDGEFL_PASSWORD": login.password,
            "OMP_NUM_THREADS": threads,
            "MKL_NUM_THREADS": threads,
            "PYTHONUNBUFFERED": "1",
            **({EMULATED_ENV: str(throttled_file(out_dir, cid))} if throttles else {}),
        }
        with (log_dir / f"{cid}.log").open("w") as fh:
            procs[cid] = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env)
        if limits is not None:
            limits.place(cid, procs[cid].pid)
    log.info("started %d client processes; their logs are in %s", len(procs), log_dir)
    return procs


def throttled_file(out_dir: Path, client_id: str) -> Path:
    """Where a simulated device that throttles reads its ``vcgencmd get_throttled`` value."""
    return out_dir / "clients" / f"{client_id}.throttled"


def throttling(fleet: Fleet, limits: CpuLimits, out_dir: Path) -> Callable[[int], None]:
    """The orchestrator's ``on_round``: devices whose profile throttles by this round (a resumed run may start after
    it) get their lower quota and report the throttled board's flags."""
    pending = {cid for cids in fleet.throttles().values() for cid in cids}

    def at_round(round_: int) -> None:
        starting = {cid for cid in pending if fleet.by_client[cid].throttled_at(round_)}
        if starting:
            pending.difference_update(starting)
            limits.update({cid: fleet.by_client[cid].share_at(round_) for cid in starting})
            for cid in starting:
                throttled_file(out_dir, cid).write_text(f"{EMULATED_THROTTLED:#x}\n")

    return at_round


def stop_clients(procs: dict[str, subprocess.Popen], timeout: float = 30.0) -> dict[str, int]:
    """Give clients ``timeout`` seconds to exit after the server's stop, then terminate, then kill."""
    deadline = time.monotonic() + timeout
    for proc in procs.values():
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.terminate()
    for cid, proc in procs.items():
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            log.warning("client %s did not exit; killing it", cid)
            proc.kill()
            proc.wait()
    return {cid: proc.returncode for cid, proc in procs.items()}


def run_processes(
    config: RunConfig,
    shards: list[Path],
    link_config: LinkConfig,
    logins: dict[str, ClientLogin],
    bundle: DatasetBundle,
    out_dir: Path,
    *,
    root: Any = None,
    observer: RoundObserver | None = None,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One ``edge-client`` process per shard, the server here, all through the broker; returns the summary.

    A fleet's clients each run under their class's CPU quota from round 1 on; the cgroups go when the clients have
    stopped.
    """
    fleet = fleet_of(config, client_ids(config.clients.count))
    with CpuLimits(fleet.shares()) if fleet else contextlib.nullcontext() as limits:
        procs = start_clients(config, link_config.url, logins, shards, out_dir, link_config.ca_file, limits)
        fleet_facts = {"fleet": {**fleet.describe(), "cpu_limits": limits.describe()}} if fleet else {}
        finished = False
        try:
            orchestrator = make_orchestrator(
                config,
                bundle,
                out_dir,
                link_config=link_config,
                root=root,
                observer=observer,
                extra={"mode": "broker", **roles_summary(config), **fleet_facts, **(extra or {})},
            )
            if limits is not None and fleet is not None:
                orchestrator.on_ready = limits.enforce
                orchestrator.on_round = throttling(fleet, limits, out_dir)
            summary = orchestrator.run()
            finished = True
        finally:  # after a failure no stop message went out: do not wait for the clients
            codes = stop_clients(procs, timeout=30.0 if finished else 0.0)
            failed = {cid: code for cid, code in codes.items() if code}
            if failed:
                log.warning("client processes exited with errors: %s (see %s/clients/)", failed, out_dir)
    return summary
