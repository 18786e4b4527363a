"""What the person running the server sees: a progress bar, one live line per round, a final table."""

from __future__ import annotations

import sys
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from server.target import Target


class RoundProgress:
    """Rich progress bar over rounds; each finished round is printed above it as one line."""

    def __init__(self, rounds: int, target: Target, console: Console | None = None) -> None:
        # Redirected output (a log file, CI) gets a width that fits the per-round line and the tables.
        self.console = console or Console(stderr=True, width=None if sys.stderr.isatty() else 140)
        self.rounds = rounds
        self.target = target
        self.progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=self.console,
            transient=True,
        )
        self.task = self.progress.add_task("starting", total=rounds)
        self._waiting = ""  # the last wait shown: without a terminal each change is a line of its own

    def __enter__(self) -> RoundProgress:
        self.progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.progress.stop()

    def waiting(self, text: str) -> None:
        """The bar's text on a terminal; elsewhere (a log file, systemd's journal) no bar is drawn, so each change of
        what the server waits for is printed as a line: a server waiting for devices never looks hung."""
        self.progress.update(self.task, description=text)
        if text != self._waiting and not self.console.is_terminal:
            self.console.print(text, highlight=False, soft_wrap=True)
        self._waiting = text

    def round_done(self, row: dict[str, Any]) -> None:
        missing = f"  missing {','.join(row['missing'])}" if row["missing"] else ""
        rejected = f"  rejected {sum(row['rejected'].values())}" if row["rejected"] else ""
        slowest = max(row["clients"].values(), key=lambda c: c["compute_s"], default={})
        of = f" ({slowest['device_class']})" if slowest.get("device_class") else ""
        parallel = f"  parallel clock {row['parallel_elapsed_s']:.1f}s" if "parallel_elapsed_s" in row else ""
        spent = f"  epsilon {row['epsilon']:.3g} (delta {row['delta']:.2g})" if "epsilon" in row else ""
        self.console.print(
            f"round {row['round']:>3}/{self.rounds}  {self._measured(row)}  "
            f"clients {row['clients_reported']}/{row['clients_selected']}  round {row['round_s']:.1f}s  "
            f"slowest compute {row['slowest_compute_s']:.2f}s{of}  elapsed {row['elapsed_s']:.1f}s{parallel}"
            f"{spent}{missing}{rejected}",
            highlight=False,
            soft_wrap=True,
        )
        value = self.target.of(row)
        shown = f" ({self.target.metric} {value:.4f})" if value is not None else ""
        self.progress.update(self.task, advance=1, description=f"training{shown}")

    def _measured(self, row: dict[str, Any]) -> str:
        """The target's metric and the loss, from whoever evaluated (the devices: how many and how long)."""
        value, loss = self.target.of(row), self.target.of(row, "loss")
        if value is None:
            return f"{self.target.metric} -  (not evaluated this round)"
        text = f"{self.target.metric} {value:.4f}" + (f"  loss {loss:.4f}" if loss is not None else "")
        if self.target.source == "clients":
            e = row["client_eval"]
            text += (
                f" on {len(e['devices'])} devices ({e['num_samples']} held out, slowest eval "
                f"{e['slowest_eval_s']:.2f}s device clock)"
            )
        return text


def summary_table(summary: dict[str, Any]) -> Table:
    """The summary.json figures a reader wants first."""

    def fmt(value: Any, unit: str = "") -> str:
        if value is None:
            return "not reached"
        if isinstance(value, float):
            return f"{value:.1f}{unit}" if unit else f"{value:.4f}"
        return f"{value}{unit}"

    table = Table(title="edgefl run summary", show_header=False)
    table.add_column(style="bold")
    table.add_column(justify="right")
    metric = summary.get("target_metric", "accuracy")
    rows = [
        ("algorithm", summary.get("algorithm")),
        (f"final {metric}", fmt(summary.get(f"final_{metric}"))),
        (f"best {metric}", fmt(summary.get(f"best_{metric}"))),
        ("evaluated by", summary.get("evaluated_by")),
        ("rounds", fmt(summary.get("rounds"))),
        ("wall clock", fmt(summary.get("wall_clock_s"), " s")),
        (f"target {metric}", "none set" if summary.get("target") is None else fmt(summary["target"])),
        ("rounds to target", fmt(summary.get("rounds_to_target"))),
        ("wall clock to target", fmt(summary.get("time_to_target_s"), " s")),
        ("client compute to target (device clock)", fmt(summary.get("client_compute_to_target_s"), " s")),
        ("fleet compute (all clients, device clocks)", fmt(summary.get("fleet_compute_s"), " s")),
        (
            "MB through the server's link (up / down)",
            f"{summary.get('bytes_up', 0) / 1e6:.2f} / {summary.get('bytes_down', 0) / 1e6:.2f}",
        ),
        (
            "MB through the server's link to target",
            "not reached" if (b := summary.get("bytes_to_target")) is None else f"{b / 1e6:.2f}",
        ),
        ("upload codecs", ", ".join(f"{c} x{n}" for c, n in (summary.get("codec_mix") or {}).items()) or "-"),
    ]
    if "privacy" in summary:  # differential privacy: the budget spent, and why the run stopped early
        p = summary["privacy"]
        rows.append(("epsilon spent", f"{p['epsilon']:.3f} (delta {p['delta']:.2g}, {p['mode']})"))
        if p["stopped_by_budget"]:
            rows.append(("stopped by the budget", p["stopped_by_budget"]))
    if "parallel_clock_s" in summary:  # in-process: the time a fleet of these devices would take
        rows.insert(6, ("parallel clock", fmt(summary["parallel_clock_s"], " s")))
        rows.insert(10, ("parallel clock to target", fmt(summary["parallel_clock_to_target_s"], " s")))
    for name, value in rows:
        table.add_row(name, str(value))
    return table


def megabytes(n: int) -> str:
    """Three significant digits: a small model's traffic (kilobytes a round) must not read 0.0."""
    return f"{n / 1e6:.3g}"


def clients_table(per_client: dict[str, dict[str, Any]], missed: dict[str, int] | None = None) -> Table:
    """What each device spent: the per_client part of summary.json (its evaluations when any device evaluated), and
    the rounds each missed (summary.json's rounds_missed). Seconds are per round on the device's clock; bytes are
    the run's total through the device's own link, its share of every model broadcast included."""
    missed = missed or {}
    table = Table(title="per client")
    evaluated = any(s.get("evaluations") for s in per_client.values())
    columns = ("client", "rounds", "missed", "compute s / round", "cpu s / round", "MB up (its link)",
               "MB down (its link)", "peak RSS MB", "max °C", "throttled",
               *(("evals", "eval s / eval") if evaluated else ()))  # fmt: skip
    for col in columns:
        table.add_column(col, justify="left" if col in ("client", "throttled") else "right")
    for cid in sorted({*per_client, *missed}):
        s = per_client.get(cid)
        if s is None:  # selected every time it was, and never reported
            table.add_row(cid, "0", str(missed[cid]), *["-"] * (len(columns) - 3))
            continue
        temp, eval_s = s["max_temperature_c"], s.get("mean_eval_s")
        table.add_row(
            cid, str(s["rounds"]), str(missed.get(cid, 0)), f"{s['mean_compute_s']:.3f}", f"{s['mean_cpu_s']:.3f}",
            megabytes(s["bytes_up"]), megabytes(s["bytes_down"]), f"{s['peak_rss_mb'] or 0:.0f}",
            "-" if temp is None else f"{temp:.1f}", ",".join(s["throttled_flags"]) or "-",
            *((str(s["evaluations"]), "-" if eval_s is None else f"{eval_s:.3f}") if evaluated else ()),
        )  # fmt: skip
    return table


def classes_table(per_class: dict[str, dict[str, Any]]) -> Table:
    """Compute and missed rounds per device class (summary.json's per_class): compute seconds are the class's total
    over the run (device clocks); train-only: FedUmf's unselected."""
    table = Table(title="per device class")
    columns = ("class", "clients", "rounds reported", "rounds missed", "compute s (total)",
               "train-only compute s (total)", "local steps", "s / 100 steps")  # fmt: skip
    for col in columns:
        table.add_column(col, justify="left" if col == "class" else "right")
    for name, c in per_class.items():
        per_100 = c["s_per_100_steps"]
        table.add_row(
            name, str(c["clients"]), str(c["rounds_reported"]), str(c["rounds_missed"]), f"{c['compute_s']:.1f}",
            f"{c['train_only_compute_s']:.1f}", f"{c['local_steps']:,}", "-" if per_100 is None else f"{per_100:.3f}",
        )  # fmt: skip
    return table
