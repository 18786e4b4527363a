"""`edge-client`: the device's command line."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from edge_client import __version__
from edge_client.chunking import DEFAULT_CHUNK_SIZE


def _password(args: argparse.Namespace) -> str | None:
    """A password never needs to appear on a command line (visible in ``ps``): file or environment first."""
    if args.password_file:
        return Path(args.password_file).read_text().strip()
    return args.password or os.environ.get("EDGEFL_PASSWORD")


def cmd_run(args: argparse.Namespace) -> int:
    from edge_client.data import load_local_data
    from edge_client.runtime import EdgeClient
    from edge_client.transport import LinkConfig

    dataset = load_local_data(args.data)
    config = LinkConfig(
        url=args.broker,
        username=args.username or args.client_id,
        password=_password(args),
        ca_file=args.ca_file,
        chunk_size=args.chunk_size,
        keepalive=args.keepalive,
    )
    client = EdgeClient(
        args.client_id,
        dataset,
        config,
        job=args.job,
        threads=args.threads,
        state_dir=Path(args.state_dir) if args.state_dir else None,
        behaviour=args.behaviour,
    )
    client.run(max_rounds=args.max_rounds)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="edge-client", description="edgefl device runtime: local training over MQTT")
    parser.add_argument("--version", action="version", version=f"edgefl {__version__}")
    parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR (default INFO)")
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser(
        "run",
        help="register with the server and train on its assignments until it says stop",
        description="Register with the server, train on each assignment, report the update.",
    )
    run.add_argument("--broker", required=True, help="broker URL, mqtt://HOST:PORT or mqtts://HOST:PORT for TLS")
    run.add_argument("--client-id", required=True, help="this device's id (letters, digits, _ . -; at most 64)")
    run.add_argument(
        "--data",
        required=True,
        help="this device's data: an .npz with x and y, or a directory of MNIST-style idx files",
    )
    run.add_argument("--username", help="broker username (default: the client id)")
    run.add_argument("--password", help="broker password (prefer --password-file or the EDGEFL_PASSWORD variable)")
    run.add_argument("--password-file", help="file holding the broker password")
    run.add_argument("--ca-file", help="CA certificate for mqtts:// brokers (default: the system's CAs)")
    run.add_argument("--job", default="default", help="job name: the topic namespace shared with the server")
    run.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads for training")
    run.add_argument("--chunk-size", type=int, default=DEFAULT_CHUNK_SIZE, help="bytes per MQTT message chunk")
    run.add_argument("--keepalive", type=int, default=60, help="MQTT keepalive seconds (long enough for an upload)")
    run.add_argument(
        "--state-dir",
        help="directory where algorithm state that must survive a restart is kept "
        "(SCAFFOLD's control variate, FedUmf's stored update)",
    )
    run.add_argument(
        "--behaviour",
        default="honest",
        help="for robustness experiments only: honest (default), "
        "freeloader (uploads the last global update, no training) or scale:SIGMA (scales its update by "
        "p ~ N(0, SIGMA^2))",
    )
    run.add_argument("--max-rounds", type=int, help="exit after this many updates (default: until the server stops)")
    run.set_defaults(func=cmd_run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except KeyboardInterrupt:
        return 130
    except (ConnectionError, FileNotFoundError, ValueError) as exc:
        logging.getLogger("edge-client").error("%s", exc)
        return 2


if __name__ == "__main__":
    sys.exit(main())
