"""`edge-server`: start a broker, run the server against devices, or simulate a whole federation here."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import os
import signal
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from edge_client.wire.transport import LinkConfig
from server import device_profiles
from server.config import ConfigError, RunConfig, load_config, override
from server.dashboard.server import Address, DashboardServer, announce, serve_dashboard
from server.live_state import run_facts
from server.metrics_endpoint import METRICS_HELP, serve_metrics

if TYPE_CHECKING:
    from server.bridge import BridgeSettings

log = logging.getLogger("edgefl.server")
BROKER_DIED = 69  # EX_UNAVAILABLE: `edge-server broker` exits with it when its mosquitto dies

DATASET_HELP = (
    "mnist, mnist-parity, digits, fmnist, adult, shakespeare, NAME:DIR for your own files, or a path to an .npz / "
    "idx directory / .csv file with --label-column (docs/datasets.md)"
)
FLEET_HELP = (
    "simulated device classes in client order, e.g. pi5:2,pi4:5,pi3:3 (edge-server fleet list; --clients follows): "
    "each client process under its class's CPU quota (a cgroup), in-process its compute scaled by its profile"
)
PARTITION_HELP = (
    "iid, dirichlet:PHI (dirichlet:PHI:balanced adds NIID-Bench's balancing step), taco-groups, fedveca-case:N "
    "(N=1-3), drag-q:Q, shards:K, unbalanced:SIGMA or natural"
)
DASHBOARD_HELP = (
    "serve a live dashboard of the run at HOST:PORT, e.g. 127.0.0.1:8050 (port 0: a free one); an address that is "
    "not loopback gets a token, printed at start, that every request must carry"
)
# flag -> (config key, type, help)
RUN_FLAGS: dict[str, tuple[str, type, str]] = {
    "--algorithm": ("train__algorithm", str, "aggregation algorithm (docs/algorithms.md)"),
    "--dataset": (
        "data__dataset",
        str,
        DATASET_HELP,
    ),
    "--label-column": ("data__label_column", str, "a .csv --dataset: the column holding the target (docs/datasets.md)"),
    "--rounds": ("run__rounds", int, "number of rounds"),
    "--local-steps": ("train__local_steps", int, "local SGD steps per round (tau)"),
    "--batch-size": ("train__batch_size", int, "mini-batch size"),
    "--lr": ("train__lr", float, "local learning rate"),
    "--target-accuracy": ("run__target_accuracy", float, "test accuracy counted as reached (time-to-accuracy)"),
    "--target": ("run__target", float, "value of run.target_metric counted as reached (time-to-target)"),
    "--target-metric": ("run__target_metric", str, "metric of the time-to-target (default: the task's main one)"),
    "--eval": ("eval__mode", str, "who evaluates: server (its test set), clients (the devices' held-out splits), both"),
    "--seed": ("run__seed", int, "seed for initialisation, partition and sampling"),
    "--out": ("run__out", str, "output directory for metrics.jsonl, summary.json, report.png"),
    "--fraction": ("clients__fraction", float, "fraction C of clients selected per round"),
    "--round-deadline": ("clients__round_deadline_s", float, "seconds a round waits for updates"),
    "--job": ("run__job", str, "job name (topic namespace)"),
    "--broker": ("broker__url", str, "use this broker (mqtt://HOST:PORT or mqtts://...) instead of starting one"),
    "--username": ("broker__username", str, "broker username of the server"),
    "--ca-file": ("broker__ca_file", str, "CA certificate for an mqtts:// broker"),
    "--codec": (
        "train__codec",
        str,
        "upload codec of every device: fp32, fp16, int8, topk:F or topk:F+int8 (docs/compression.md); with "
        "train.codec_policy = 'link' in the config, the codec of devices whose link is not measured yet",
    ),
    "--max-packet-size": (
        "broker__max_packet_size",
        int,
        "the broker's packet limit in bytes when it advertises none (ejabberd); 0: what the broker says",
    ),
    "--privacy": ("privacy__mode", str, "differential privacy: off, central or local (docs/privacy.md)"),
    "--clip-norm": ("privacy__clip_norm", float, "DP: the L2 norm every device clips its update to"),
    "--noise-multiplier": ("privacy__noise_multiplier", float, "DP: noise std / clip norm (0: from --target-epsilon)"),
    "--target-epsilon": ("privacy__target_epsilon", float, "DP: the budget; the run stops before exceeding it"),
}


def _add_run_flags(parser: argparse.ArgumentParser, extra: dict[str, tuple[str, type, str]]) -> None:
    parser.add_argument("--config", help="TOML run configuration (flags override it)")
    for flag, (dest, kind, text) in {**RUN_FLAGS, **extra}.items():
        parser.add_argument(flag, dest=dest, type=kind, help=text)
    parser.add_argument(
        "--stop-at-target",
        dest="run__stop_at_target",
        action="store_const",
        const=True,
        help="stop as soon as the target accuracy is reached",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log every client event on the console too")
    parser.add_argument("--dashboard", metavar="HOST:PORT", help=DASHBOARD_HELP)
    parser.add_argument("--metrics", metavar="HOST:PORT", help=METRICS_HELP)
    parser.add_argument(
        "--model-path",
        action="append",
        metavar="DIR",
        help='directory holding the module of [model]/[task] factory = "module:callable" (put on the import path)',
    )


def _config(args: argparse.Namespace) -> RunConfig:
    """The validated configuration, the algorithm and its settings included, before anything is started."""
    from edge_client.learning.factories import AllowedCode
    from server.strategies import build_strategy

    AllowedCode.of(args.model_path or ()).activate()
    flags = {k: v for k, v in vars(args).items() if "__" in k}
    config = override(load_config(args.config), **flags)
    build_strategy(config)  # checks what a contract alone cannot (e.g. FedVeca's tau_min_reset <= tau_max)
    return config


def settings_help() -> str:
    """Every algorithm's settings as its contract declares them, for the run and simulate ``--help``."""
    from edge_client.algorithms import CONTRACTS
    from edge_client.algorithms.contract import settings_rows

    lines = ["algorithm settings, set in a config file as [algorithm.NAME] SETTING = VALUE (docs/algorithms.md):"]
    current = ""
    for algorithm, name, _, default, allowed, meaning in settings_rows(CONTRACTS.values()):
        if algorithm != current:
            current = algorithm
            lines.append(f"  {algorithm}: {CONTRACTS[algorithm].description}")
        lines.append(f"    {name} = {default}  ({allowed}): {meaning}")
    return "\n".join(lines)


def _setup_logging(out_dir: Path, verbose: bool, log_name: str = "server.log") -> None:
    from rich.logging import RichHandler

    out_dir.mkdir(parents=True, exist_ok=True)
    # Appended: a server restarted on the same directory resumes its run (and a bench its runs), so the log of the
    # interrupted part must stay.
    file_handler = logging.FileHandler(out_dir / log_name, mode="a")
    file_handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    # A bench's console is its progress bar and one line per run; warnings of its many runs stay in bench.log.
    quiet = logging.ERROR if log_name == "bench.log" else logging.WARNING
    console = RichHandler(level=logging.INFO if verbose else quiet, show_path=False, markup=False)
    console.setFormatter(logging.Formatter("%(name)s: %(message)s"))  # the handler shows the level itself
    logging.basicConfig(level=logging.INFO, handlers=[file_handler, console], force=True)


@contextlib.contextmanager
def _broker_for(config: RunConfig, out_dir: Path, devices: list[str]) -> Iterator[tuple[LinkConfig, Any]]:
    """The server's link: to ``broker.url`` when given, else to a mosquitto started for this run."""
    b = config.broker
    if b.url:
        password = b.password or os.environ.get("EDGEFL_PASSWORD")
        limit = b.max_packet_size or None  # 0: what the broker advertises
        link = LinkConfig(b.url, b.username, password, ca_file=b.ca_file or None, chunk_size=b.chunk_size)
        yield dataclasses.replace(link, max_packet_size=limit), None
        return
    from server.broker import Broker, BrokerSettings

    broker = Broker(out_dir / "broker", BrokerSettings(server_user=b.username, devices=devices)).start()
    try:
        broker.write_credentials(out_dir / "broker" / "credentials.json")
        creds = broker.server
        yield LinkConfig(broker.url, creds.username, creds.password, chunk_size=b.chunk_size), broker
    finally:
        broker.stop()


def _report(summary: dict[str, Any], out_dir: Path, console: Any) -> None:
    from server.progress import classes_table, clients_table, summary_table

    console.print(summary_table(summary))
    console.print(classes_table(summary["per_class"]))
    console.print(clients_table(summary["per_client"], summary["rounds_missed"]))
    console.print(f"wrote {out_dir}/metrics.jsonl, summary.json, report.png, timeline.png and server.log")


def _print_partition(bundle: Any, scheme: str, table: str) -> None:
    print(
        f"{bundle.name}: {len(bundle.train)} training / {len(bundle.test)} test samples, partition {scheme}; "
        f"labels per client:\n{table}",
        file=sys.stderr,
    )


def cmd_partition(args: argparse.Namespace) -> int:
    from server.datasets import load_dataset
    from server.experiments.simulate import client_ids, prepare_shards

    ids = [i for i in (args.ids or "").split(",") if i] or client_ids(args.clients)
    bundle = load_dataset(args.dataset, seed=args.seed, label_column=args.label_column)
    shards, table = prepare_shards(bundle, ids, args.partition, args.seed, Path(args.out))
    _print_partition(bundle, args.partition, table)
    print(f"wrote {len(shards)} shards to {args.out}/ (copy <id>.npz to each device, pass it as --data)")
    return 0


def cmd_simulate(args: argparse.Namespace) -> int:
    from server.assembly import dataset_name, dataset_of, run_target_of, split_clients
    from server.experiments.inprocess import run_inprocess
    from server.experiments.simulate import ClientLogin, client_ids, prepare_shards, run_processes
    from server.progress import RoundProgress

    config = _config(args)
    out_dir = Path(config.run.out)
    _setup_logging(out_dir, args.verbose)
    bundle, root = split_clients(config, dataset_of(config))
    ids = client_ids(config.clients.count)
    shards, table = prepare_shards(bundle, ids, config.data.partition, config.run.seed, out_dir / "shards")
    _print_partition(bundle, config.data.partition, table)
    target = run_target_of(config, bundle)
    with (
        serve_dashboard(args.dashboard, out_dir, run_facts(config, dataset_name(bundle), target.value)),
        RoundProgress(config.run.rounds, target) as progress,
        serve_metrics(args.metrics, out_dir, target, config.train.algorithm, progress) as observer,
    ):
        if args.in_process:
            summary = run_inprocess(config, shards, bundle, out_dir, root=root, observer=observer)
        else:
            with _broker_for(config, out_dir, ids) as (link, broker):
                if broker is not None:
                    logins = {cid: ClientLogin(cid, broker.devices[cid].password) for cid in ids}
                else:  # an external broker: the clients share the server's login
                    logins = {cid: ClientLogin(link.username or "", link.password or "") for cid in ids}
                summary = run_processes(config, shards, link, logins, bundle, out_dir, root=root, observer=observer)
    _report(summary, out_dir, progress.console)
    return 0


def cmd_fleet(args: argparse.Namespace) -> int:
    from rich.console import Console

    if args.fleet_command == "list":
        known = device_profiles.profiles(load_config(args.config).fleet.profiles)
        console = Console()
        console.print(fleet_table(known))
        console.print(
            f"CPU share: of one core of this machine. Reference: {device_profiles.REFERENCE_SOURCE}.", highlight=False
        )
        for name, p in sorted(known.items()):
            console.print(f"{name}: {p.source}", highlight=False)
        return 0
    from edge_client.tools.speed import DEFAULT_MODELS, benchmark

    if args.model not in DEFAULT_MODELS:
        raise ValueError(f"--model {args.model!r}: choose one of {', '.join(DEFAULT_MODELS)} (edge-client benchmark's)")
    links = (args.uplink_mbps, args.downlink_mbps) if args.uplink_mbps and args.downlink_mbps else None
    if (args.uplink_mbps is None) != (args.downlink_mbps is None):
        raise ValueError("give both --uplink-mbps and --downlink-mbps, or neither (the shipped profile's rates)")
    print(f"measuring this machine: {args.model}, FedAvg, 100 steps of batch 64 on one thread, {args.repeats} times")
    [result] = benchmark({args.model: DEFAULT_MODELS[args.model]}, ["fedavg"], repeats=args.repeats, inference=False)
    host = result["cpu_s_per_100"]
    profile = device_profiles.calibrated(args.name, args.seconds_per_100_steps, host, links)
    print(
        f"this machine: {host:.3f} CPU s per 100 steps (wall {result['s_per_100']:.3f} s); a device that needs "
        f"{args.seconds_per_100_steps:g} s is {profile.cpu_share:g} of one core here"
        + (" (capped at 1: it is faster than one core here)" if host > args.seconds_per_100_steps else "")
        + ". Add to your configuration:\n"
    )
    print(device_profiles.profile_toml(profile))
    return 0


def fleet_table(profiles: dict[str, Any]) -> Any:
    """``edge-server fleet list``: every profile with where its numbers come from."""
    from rich.table import Table

    ref_model, ref_s = device_profiles.REFERENCE_MODEL, device_profiles.REFERENCE_S_PER_100
    table = Table(title="device profiles (sources below)")
    for col in ("class", "CPU share", f"s / 100 steps of {ref_model}", "uplink Mbit/s", "downlink Mbit/s"):
        table.add_column(col, justify="left" if col == "class" else "right")
    for name, p in sorted(profiles.items()):
        table.add_row(
            name, f"{p.cpu_share:.4g}", f"{ref_s / p.cpu_share:.3g}", f"{p.uplink_mbps:g}",
            f"{p.downlink_mbps:g}",
        )  # fmt: skip
    return table


def cmd_run(args: argparse.Namespace) -> int:
    from server.assembly import dataset_name, make_orchestrator, run_target_of, server_data
    from server.progress import RoundProgress

    config = _config(args)
    out_dir = Path(config.run.out)
    _setup_logging(out_dir, args.verbose)
    bundle, root = server_data(config)
    target = run_target_of(config, bundle)
    with _broker_for(config, out_dir, config.broker.devices) as (link, broker):
        if broker is not None:
            print(
                f"started mosquitto at {broker.url}; device credentials in {out_dir}/broker/credentials.json",
                file=sys.stderr,
            )
        with (
            serve_dashboard(args.dashboard, out_dir, run_facts(config, dataset_name(bundle), target.value)),
            RoundProgress(config.run.rounds, target) as progress,
            serve_metrics(args.metrics, out_dir, target, config.train.algorithm, progress) as observer,
        ):
            summary = make_orchestrator(config, bundle, out_dir, link_config=link, root=root, observer=observer).run()
    _report(summary, out_dir, progress.console)
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from server.experiments.runner import run_suite
    from server.experiments.suites import load_suite, shipped

    if args.list:
        for name in shipped():
            print(f"{name:<16} {load_suite(name).description}")
        return 0
    suite = load_suite(args.suite, args.config)
    if args.seeds:
        suite.seeds = [int(s) for s in args.seeds.split(",")]
    if args.algorithms:
        suite.algorithms = [a for a in args.algorithms.split(",") if a]
    if args.more_seeds is not None:
        suite.more_seeds = [int(s) for s in args.more_seeds.split(",") if s]
    if args.fleet:
        suite.use_fleet(args.fleet)
    if args.rounds:
        suite.use_rounds(args.rounds)
    out_dir = Path(args.out or f"runs/bench-{suite.name}")
    _setup_logging(out_dir, args.verbose, log_name="bench.log")
    run_suite(suite, out_dir, args.mode)
    print((out_dir / "accuracy.md").read_text())
    print(f"wrote {out_dir}/report.md with every table (.md and .csv beside it) and the plots")
    return 0


def _sites(specs: list[str]) -> dict[str, list[str]]:
    """``--site NAME:ID,ID`` flags as {site login: its devices}."""
    sites: dict[str, list[str]] = {}
    for spec in specs:
        name, _, ids = spec.partition(":")
        devices = [d for d in ids.split(",") if d]
        if not name or not devices or name in sites:
            raise ValueError(
                f"--site {spec!r}: expected NAME:ID,ID,... (a site's login and its devices), once per site"
            )
        sites[name] = devices
    return sites


def _bridge(args: argparse.Namespace) -> BridgeSettings | None:
    """The site's bridge to the central broker from ``--bridge`` and its login flags; None without ``--bridge``."""
    from server.bridge import BridgeSettings

    if not args.bridge:
        return None
    password = (
        Path(args.bridge_password_file).read_text().strip()
        if args.bridge_password_file
        else os.environ.get("EDGEFL_BRIDGE_PASSWORD", "")
    )
    if not args.bridge_username or not password:
        raise ValueError(
            "--bridge needs the site's login on the central broker: --bridge-username NAME and "
            "--bridge-password-file FILE (or the EDGEFL_BRIDGE_PASSWORD environment variable)"
        )
    return BridgeSettings(args.bridge, args.bridge_username, password, args.bridge_ca_file)


def cmd_dashboard(args: argparse.Namespace) -> int:
    run_dir = Path(args.out)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"--out {run_dir}: no such run directory (the --out of a run or simulate)")
    server = DashboardServer(run_dir, Address.parse(args.dashboard)).start()
    announce(server)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    with contextlib.suppress(KeyboardInterrupt):
        stop.wait()
    server.stop()
    return 0


def cmd_broker(args: argparse.Namespace) -> int:
    from server.broker import Broker, BrokerSettings

    devices = [d for d in (args.devices or "").split(",") if d] + [f"device-{i:02d}" for i in range(args.clients)]
    settings = BrokerSettings(
        host=args.host,
        port=args.port,
        devices=devices,
        certfile=args.certfile,
        keyfile=args.keyfile,
        sites=_sites(args.site or []),
        bridge=_bridge(args),
    )
    workdir = Path(args.dir)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())  # before start: SIGTERM must always stop mosquitto too
    with Broker(workdir, settings).start() as broker:
        broker.write_credentials(workdir / "credentials.json")
        print(f"mosquitto for edgefl listening at {broker.url}")
        print(f"server login: {broker.server.username} / {broker.server.password}")
        for cid, creds in broker.devices.items():
            print(f"device login: {cid} / {creds.password}")
        for site, creds in broker.sites.items():
            print(f"site login: {site} / {creds.password} (its bridge carries {', '.join(settings.sites[site])})")
        if settings.bridge is not None:
            print(f"bridging these devices to {settings.bridge.url} as {settings.bridge.username}")
        print(f"credentials written to {workdir / 'credentials.json'}; Ctrl-C stops the broker", flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            while not stop.wait(1.0):  # supervise: a dead broker must not look like a running one
                died = broker.died()
                if died is not None:
                    print(f"edge-server: error: {died}\nexiting so that a service manager (or you) can start it again",
                          file=sys.stderr, flush=True)  # fmt: skip
                    return BROKER_DIED
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="edge-server", description="edgefl server: federated training over MQTT")
    sub = parser.add_subparsers(dest="command", required=True)

    sim = sub.add_parser(
        "simulate",
        help="broker + server + N edge-client processes on this machine",
        description="Start a broker, the server and N edge-client processes on this machine, all "
        "talking through the broker exactly as devices would. With no flags: 10 clients train the "
        "TACO CNN on MNIST with FedAvg.",
        epilog=settings_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_run_flags(
        sim,
        {
            "--clients": ("clients__count", int, "number of client processes"),
            "--partition": (
                "data__partition",
                str,
                PARTITION_HELP,
            ),
            "--threads": ("simulation__threads", int, "torch threads per client process"),
            "--fleet": ("fleet__devices", str, FLEET_HELP),
        },
    )
    sim.add_argument(
        "--in-process",
        action="store_true",
        help="run the clients one after another in this process instead of as processes behind a broker "
        "(same algorithm code; compute times free of contention between clients)",
    )
    sim.set_defaults(func=cmd_simulate)

    run = sub.add_parser(
        "run",
        help="run the server for real devices",
        description="Orchestrate rounds for devices that connect to the broker on their own.",
        epilog=settings_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_run_flags(run, {"--min-clients": ("clients__min_clients", int, "clients to wait for before round 1")})
    run.set_defaults(func=cmd_run)

    part = sub.add_parser(
        "partition",
        help="split a data set into one .npz per device",
        description="Partition a data set's training split and write <id>.npz per device, for edge-client run --data.",
    )
    part.add_argument(
        "--dataset",
        default="mnist",
        help=DATASET_HELP,
    )
    part.add_argument(
        "--partition",
        default="iid",
        help=PARTITION_HELP,
    )
    part.add_argument("--label-column", default="", help=RUN_FLAGS["--label-column"][2])
    part.add_argument("--clients", type=int, default=10, help="number of shards (ids client-00 ..)")
    part.add_argument("--ids", help="comma-separated device ids instead of client-NN")
    part.add_argument("--seed", type=int, default=0, help="partition seed")
    part.add_argument("--out", default="shards", help="output directory")
    part.set_defaults(func=cmd_partition)

    bench = sub.add_parser(
        "bench",
        help="run a suite of algorithms x partitions x seeds and write the papers' tables and plots",
        description="Run every algorithm of a suite on the identical partitions and seeds, then write "
        "round-to-accuracy, time-to-accuracy, client compute and freeloader tables (Markdown and CSV) and "
        "accuracy plots. A finished run is kept when the same output directory is used again.",
    )
    which = bench.add_mutually_exclusive_group(required=True)
    which.add_argument("--suite", help="a shipped suite (see --list)")
    which.add_argument("--config", help="a suite file: a run configuration plus a [bench] section")
    which.add_argument("--list", action="store_true", help="list the shipped suites")
    bench.add_argument(
        "--mode",
        choices=["inprocess", "broker"],
        help="inprocess: clients one after another in this process; broker: one process per client behind "
        "mosquitto (default: the suite's)",
    )
    bench.add_argument("--out", help="output directory (default runs/bench-<suite>)")
    bench.add_argument("--seeds", help="comma-separated seeds instead of the suite's")
    bench.add_argument("--algorithms", help="comma-separated algorithms instead of the suite's")
    bench.add_argument("--fleet", help=f"instead of the suite's fleet: {FLEET_HELP}")
    bench.add_argument(
        "--more-seeds", help="comma-separated extra seeds for the suite's more_seeds_for rows (empty: none)"
    )
    bench.add_argument("--rounds", type=int, help="rounds of every run instead of the suite's (a quick check)")
    bench.add_argument("-v", "--verbose", action="store_true", help="log every client event on the console too")
    bench.set_defaults(func=cmd_bench)

    fleet = sub.add_parser(
        "fleet",
        help="device profiles for simulated fleets: list them, or calibrate one from a real device's benchmark",
        description="A profile is a CPU share of one core of this machine plus uplink and downlink rates; "
        "--fleet pi5:2,pi4:5,pi3:3 on simulate and bench uses them (docs/fleets.md).",
    )
    fleet_sub = fleet.add_subparsers(dest="fleet_command", required=True)
    listing = fleet_sub.add_parser("list", help="the shipped profiles (and a config's [fleet.profiles.NAME])")
    listing.add_argument("--config", help="also list this configuration's [fleet.profiles.NAME] tables")
    calibrate = fleet_sub.add_parser(
        "calibrate",
        help="turn a device's edge-client benchmark figure into a profile for this machine",
        description="Measure this machine's CPU seconds per 100 local steps of MODEL (FedAvg, batch 64, one thread: "
        "edge-client benchmark's defaults) and print the [fleet.profiles.NAME] table of a device that needs "
        "--seconds-per-100-steps for the same.",
    )
    calibrate.add_argument(
        "--seconds-per-100-steps", type=float, required=True, help="the device's figure from edge-client benchmark"
    )
    calibrate.add_argument("--model", default="cnn-mnist", help="the model it was measured on (default cnn-mnist)")
    calibrate.add_argument("--name", default="mydevice", help="the profile's name (a shipped one is replaced)")
    calibrate.add_argument("--uplink-mbps", type=float, help="the device's uplink (default: the shipped profile's)")
    calibrate.add_argument("--downlink-mbps", type=float, help="the device's downlink (default: the shipped profile's)")
    calibrate.add_argument("--repeats", type=int, default=3, help="measurements of this machine (default 3)")
    fleet.set_defaults(func=cmd_fleet)

    dash = sub.add_parser(
        "dashboard",
        help="serve the live dashboard of a run from its output directory",
        description="Serve the dashboard of a finished or running run from its output directory alone (live.json, "
        "metrics.jsonl); it follows a running run as it trains.",
    )
    dash.add_argument("--out", default="runs/latest", help="the run's output directory (default runs/latest)")
    dash.add_argument("--dashboard", metavar="HOST:PORT", default="127.0.0.1:8050", help=DASHBOARD_HELP)
    dash.set_defaults(func=cmd_dashboard)

    broker = sub.add_parser(
        "broker",
        help="start a mosquitto configured for edgefl and print its credentials",
        description="Start mosquitto with a generated config, password file and ACL.",
    )
    broker.add_argument("--dir", default="edgefl-broker", help="directory for config, passwords, ACL, persistence")
    broker.add_argument("--host", default="127.0.0.1", help="address to listen on")
    broker.add_argument("--port", type=int, help="port (default: a free one)")
    broker.add_argument("--devices", help="comma-separated device ids to create logins for")
    broker.add_argument("--clients", type=int, default=0, help="also create logins device-00 .. device-NN")
    broker.add_argument(
        "--certfile",
        help="PEM server certificate (e.g. server.crt from provision-broker.sh init); required unless --host is a "
        "loopback address",
    )
    broker.add_argument("--keyfile", help="PEM private key of --certfile")
    broker.add_argument(
        "--site",
        action="append",
        metavar="NAME:ID,ID",
        help="central broker: create a login NAME for a site broker's bridge that may carry only these devices' "
        "topics (repeat per site; docs/scaling.md)",
    )
    broker.add_argument(
        "--bridge",
        metavar="URL",
        help="site broker: bridge the devices' topics to the central broker at URL (mqtts://HOST:PORT), where the "
        "server runs; the devices are --devices/--clients and must match the central broker's --site entry",
    )
    broker.add_argument("--bridge-username", help="this site's login on the central broker (its --site NAME)")
    broker.add_argument(
        "--bridge-password-file", help="file holding that login's password (or set EDGEFL_BRIDGE_PASSWORD)"
    )
    broker.add_argument("--bridge-ca-file", help="CA certificate of the central broker (default: the system's CAs)")
    broker.set_defaults(func=cmd_broker)
    return parser


STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP, raised where Ctrl-C's KeyboardInterrupt would be, so that it takes the same path."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _terminate(signum: int, _frame: Any) -> None:
    """`kill`, `systemctl stop` (SIGTERM) and a closed terminal (SIGHUP) stop a command as Ctrl-C does: every
    `finally` runs, so the clients, the mosquitto and the dashboard it started stop with it (the default action ends
    the process at once and leaves them running). A repeat while it cleans up is ignored: SIGKILL is the way to
    abandon the cleanup."""
    for s in STOP_SIGNALS:
        signal.signal(s, signal.SIG_IGN)
    raise Terminated(signum)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    for s in STOP_SIGNALS:
        signal.signal(s, _terminate)
    try:
        return args.func(args)
    except Terminated as exc:
        return 128 + exc.signum  # the shell's status of a process its signal ended
    except KeyboardInterrupt:
        return 130
    except (ConfigError, ConnectionError, TimeoutError, FileNotFoundError, ValueError, RuntimeError) as exc:
        print(f"edge-server: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
