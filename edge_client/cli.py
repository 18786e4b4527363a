"""`edge-client`: the device's command line."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from edge_client.wire.transport import LinkConfig

from edge_client import __version__
from edge_client.exits import ExitStatus, describe
from edge_client.wire.chunking import DEFAULT_CHUNK_SIZE


class Terminated(Exception):
    """SIGTERM (``systemctl stop``): leave cleanly, telling the server this device is offline."""


def _terminate(signum: int, frame: object) -> None:
    raise Terminated


def _password(args: argparse.Namespace) -> str | None:
    """A password never needs to appear on a command line (visible in ``ps``): file or environment first."""
    if args.password_file:
        return Path(args.password_file).read_text().strip()
    return args.password or os.environ.get("EDGEFL_PASSWORD")


def _link_config(args: argparse.Namespace, **extra: Any) -> LinkConfig:
    from edge_client.wire.transport import LinkConfig

    username = args.username or args.client_id
    return LinkConfig(url=args.broker, username=username, password=_password(args), ca_file=args.ca_file, **extra)


LABEL_COLUMN_HELP = "CSV data: the column holding the target (every other one is a numeric feature)"


def cmd_fetch_model(args: argparse.Namespace) -> int:
    from edge_client.tools.fetch import fetch_model

    meta = fetch_model(_link_config(args), args.client_id, Path(args.out), job=args.job, timeout=args.timeout)
    print(f"wrote {args.out} (round {meta['round']}, sha256 {meta['sha256'][:12]}...) and {args.out}.json")
    return 0


def cmd_run(args: argparse.Namespace, train: Any = None) -> int:
    """``train``: a replacement for the local training (robustness experiments wrap it; devices never do)."""
    from edge_client.learning.data import load_local_data, split_holdout
    from edge_client.learning.factories import AllowedCode
    from edge_client.loop.runtime import EdgeClient
    from edge_client.loop.trainer import train_local

    dataset, holdout = load_local_data(args.data, args.label_column), None
    if args.holdout:
        dataset, holdout = split_holdout(dataset, args.holdout, args.holdout_seed, args.client_id)
    config = _link_config(
        args, chunk_size=args.chunk_size, keepalive=args.keepalive, max_packet_size=args.max_packet_size or None
    )
    client = EdgeClient(
        args.client_id,
        dataset,
        config,
        job=args.job,
        threads=args.threads,
        state_dir=Path(args.state_dir) if args.state_dir else None,
        train=train or train_local,
        holdout=holdout,
        allowed=AllowedCode.of(args.model_path or (), args.model_package or ()),
        device_class=args.device_class,
    )
    signal.signal(signal.SIGTERM, _terminate)
    client.run(max_rounds=args.max_rounds, once=args.once)
    return ExitStatus.FINISHED


def cmd_check(args: argparse.Namespace) -> int:
    """One line per item (edge_client/tools/check.py); exit status 0 when the device is ready, 1 when not."""
    from edge_client.tools.check import check_all, report

    def config() -> LinkConfig:  # called inside the broker item: an unreadable password file is a FAIL line
        return _link_config(args, session_expiry_s=0, connect_timeout_s=args.timeout)

    return report(check_all(config, args.client_id, args.job, args.data, args.label_column), args.client_id, args.job)


def cmd_predict(args: argparse.Namespace) -> int:
    """Inference with onnxruntime only: torch is never imported on this path."""
    import numpy as np

    from edge_client.learning.predictor import Predictor

    predictor = Predictor(args.model, intra_op_num_threads=args.threads, verify=not args.no_verify)
    with np.load(args.input, allow_pickle=False) as data:
        if args.key not in data.files:
            raise ValueError(f"{args.input} has no array {args.key!r}; it has {data.files} (choose with --key)")
        x = data[args.key]
    out = predictor.predict_proba(x, args.batch_size) if args.proba else predictor.predict(x, args.batch_size)
    if args.out:
        if args.out.endswith(".npz"):
            np.savez(args.out, predictions=out)
        else:
            np.savetxt(args.out, out, delimiter=",")
        print(f"wrote {len(out)} predictions to {args.out}")
    else:
        print("\n".join(str(v) for v in out.tolist()))
    if args.latency:
        lat = predictor.latency(x[:1], repeats=args.latency)
        print(f"latency, batch 1: median {lat['median_ms']:.3f} ms, p90 {lat['p90_ms']:.3f} ms", file=sys.stderr)
    return 0


def cmd_benchmark(args: argparse.Namespace) -> int:
    from edge_client.tools.speed import DEFAULT_MODELS, benchmark, format_table

    models = None
    if args.models:
        unknown = [m for m in args.models.split(",") if m not in DEFAULT_MODELS]
        if unknown:
            raise ValueError(f"unknown model(s) {unknown}; choose from {sorted(DEFAULT_MODELS)}")
        models = {m: DEFAULT_MODELS[m] for m in args.models.split(",")}
    algorithms = args.algorithms.split(",") if args.algorithms else None
    results = benchmark(
        models,
        algorithms,
        steps=args.steps,
        batch_size=args.batch_size,
        repeats=args.repeats,
        threads=args.threads,
        inference=not args.no_inference,
    )
    print(format_table(results))
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
        print(f"wrote {args.out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="edge-client", description="edgefl device runtime: local training over MQTT")
    parser.add_argument("--version", action="version", version=f"edgefl {__version__}")
    parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR (default INFO)")
    sub = parser.add_subparsers(dest="command", required=True)

    connection = argparse.ArgumentParser(add_help=False)
    connection.add_argument("--broker", required=True, help="broker URL, mqtt://HOST:PORT or mqtts://HOST:PORT (TLS)")
    connection.add_argument("--client-id", required=True, help="this device's id (letters, digits, _ . -; at most 64)")
    connection.add_argument("--username", help="broker username (default: the client id)")
    connection.add_argument("--password", help="broker password (prefer --password-file or EDGEFL_PASSWORD)")
    connection.add_argument("--password-file", help="file holding the broker password")
    connection.add_argument("--ca-file", help="CA certificate for mqtts:// brokers (default: the system's CAs)")
    connection.add_argument("--job", default="default", help="job name: the topic namespace shared with the server")

    run = sub.add_parser(
        "run",
        parents=[connection],
        help="register with the server and train on its assignments, run after run",
        description="Register with the server, train on each assignment, report the update; when a run ends, wait "
        "for the next one (--once: exit).",
        epilog=describe(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    run.add_argument(
        "--data",
        required=True,
        help="this device's data: an .npz with x and y, a .csv with a header (and --label-column), or a directory of "
        "MNIST-style idx files",
    )
    run.add_argument("--label-column", help=LABEL_COLUMN_HELP)
    run.add_argument(
        "--holdout",
        type=float,
        default=0.0,
        help="fraction of the data held out (never trained on) to evaluate the global model on when the server asks "
        "([eval] mode clients or both), e.g. 0.1; default 0: none",
    )
    run.add_argument("--holdout-seed", type=int, default=0, help="seed of the held-out split (with the client id)")
    run.add_argument(
        "--model-path",
        action="append",
        metavar="DIR",
        help='directory holding your model/task module ([model] factory = "module:callable"); the device imports '
        "user code only from here or --model-package (repeatable)",
    )
    run.add_argument(
        "--model-package",
        action="append",
        metavar="NAME",
        help="an installed package the server's [model]/[task] factory may come from (repeatable)",
    )
    run.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads for training")
    run.add_argument("--chunk-size", type=int, default=DEFAULT_CHUNK_SIZE, help="bytes per MQTT message chunk")
    run.add_argument("--keepalive", type=int, default=60, help="MQTT keepalive seconds (long enough for an upload)")
    run.add_argument(
        "--max-packet-size",
        type=int,
        default=0,
        help="the broker's packet limit in bytes when it advertises none (ejabberd: its max_payload_size); "
        "0 (default): the limit the broker advertises",
    )
    run.add_argument(
        "--state-dir",
        help="directory where algorithm state that must survive a restart is kept "
        "(SCAFFOLD's control variate, FedUmf's stored update)",
    )
    run.add_argument("--max-rounds", type=int, help="exit after this many updates (default: no limit)")
    run.add_argument(
        "--once",
        action="store_true",
        help="exit (status 0) when the run this device takes part in ends, instead of waiting for the next run",
    )
    run.add_argument(
        "--device-class",
        help="this device's class, e.g. pi4 (a fleet profile's name): the server reports compute and missed rounds "
        "per class",
    )
    run.set_defaults(func=cmd_run)

    fetch = sub.add_parser(
        "fetch-model",
        parents=[connection],
        help="download the server's newest ONNX model",
        description="Fetch the newest exported model (retained on the broker) for edge-client "
        "predict; writes the .onnx file and its .json sidecar.",
    )
    fetch.add_argument("--out", default="model.onnx", help="where to write the model (default model.onnx)")
    fetch.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for the model (default 30)")
    fetch.set_defaults(func=cmd_fetch_model)

    check = sub.add_parser(
        "check",
        parents=[connection],
        help="is this device ready? broker login, ACL, data, torch and onnxruntime on this CPU, device metrics",
        description="Check, one line per item, that the broker accepts this device's login, that its ACL lets the "
        "device publish its updates, that the data loads, that torch and onnxruntime run on this CPU, and show "
        "the device's metrics. Exit status 0: ready; 1: something to fix.",
    )
    check.add_argument("--data", help="this device's data file or directory to check (as edge-client run --data)")
    check.add_argument("--label-column", help=LABEL_COLUMN_HELP)
    check.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for the broker (default 10)")
    check.set_defaults(func=cmd_check)

    predict = sub.add_parser(
        "predict",
        help="predict with an exported ONNX model: class ids, binary labels or regression values (onnxruntime only)",
        description="Run the server's exported model (model.onnx) on this device.",
    )
    predict.add_argument("--model", required=True, help="model.onnx exported by the server (its .json sidecar beside)")
    predict.add_argument("--input", required=True, help=".npz holding the samples")
    predict.add_argument("--key", default="x", help="array in the .npz to predict on (default x)")
    predict.add_argument("--batch-size", type=int, help="samples per onnxruntime call (default: all at once)")
    predict.add_argument("--threads", type=int, default=1, help="onnxruntime intra-op threads (0: its default)")
    predict.add_argument("--proba", action="store_true", help="print class probabilities instead of class ids")
    predict.add_argument("--out", help="write predictions to .npz or .csv instead of printing them")
    predict.add_argument("--latency", type=int, default=0, help="also measure batch-1 latency over N repeats")
    predict.add_argument("--no-verify", action="store_true", help="skip the sha256 check against the sidecar")
    predict.set_defaults(func=cmd_predict)

    bench = sub.add_parser(
        "benchmark",
        help="seconds per 100 local updates per algorithm and model on this device",
        description="Measure this device's training cost of every algorithm (side by side, "
        "repeated) and its inference latency, to compare devices before deploying.",
    )
    bench.add_argument("--models", help="comma-separated: cnn-mnist, cnn-cifar, mlp-digits (default: all)")
    bench.add_argument("--algorithms", help="comma-separated algorithm names (default: all this client supports)")
    bench.add_argument("--steps", type=int, default=100, help="local updates per measurement (default 100)")
    bench.add_argument("--batch-size", type=int, default=64, help="mini-batch size (default 64)")
    bench.add_argument("--repeats", type=int, default=3, help="measurements per algorithm, interleaved (default 3)")
    bench.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    bench.add_argument("--no-inference", action="store_true", help="skip the ONNX inference latency")
    bench.add_argument("--out", help="also write the results as JSON")
    bench.set_defaults(func=cmd_benchmark)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log = logging.getLogger("edge-client")
    try:
        return args.func(args)
    except KeyboardInterrupt:
        log.info("interrupted (Ctrl-C)")
        return ExitStatus.INTERRUPTED
    except Terminated:
        log.info("stopped (SIGTERM)")
        return ExitStatus.FINISHED
    except (ConnectionError, TimeoutError) as exc:
        from edge_client.wire.transport import LoginRefused

        log.error("%s", exc)
        return ExitStatus.REFUSED if isinstance(exc, LoginRefused) else ExitStatus.UNAVAILABLE
    except (FileNotFoundError, PermissionError, ValueError) as exc:
        log.error("%s", exc)
        return ExitStatus.CONFIG
    except RuntimeError as exc:
        from edge_client.loop.runtime import Refused

        if not isinstance(exc, Refused):
            raise
        log.error("%s", exc)
        return ExitStatus.CONFIG


if __name__ == "__main__":
    sys.exit(main())
