"""Every shell command block of the README and the guides it links runs, on loopback, as a reader would run it.

A guide's section (the blocks under one heading) runs in a scratch directory of its own, which holds the checkout's
`examples/`, `firmware_scripts/` and `scripts/` and a `.venv/bin/` whose `edge-server`, `edge-client` and `python`
run this checkout. Each command is the block's text with these substitutions (docs/testing.md describes them):

- `SERVER`, `broker.lan` and `0.0.0.0` become 127.0.0.1; a port after `--port` or in a URL becomes a free port
  (the same number, the same free port, within the section);
- `/etc/...`, `/var/...` and `/opt/...` move under the scratch directory; `sudo ` is dropped (the test runs as root);
- `<server password>`, `<its password>` (the command's `--client-id`) and `<ID password>` come from the
  `credentials.json` of the broker the section started (`edge-server broker --dir DIR`);
- `edge-server run`, `simulate` and `bench` and `python -m benchmarks.fleet` train one round (`--rounds 1`).

Programs that serve until stopped (`edge-server broker`, `edge-server run`, `edge-client run`) start as in a terminal
of their own: a broker is waited for until its credentials are written; at the end of the section every
`edge-server run` must have finished with status 0 and the others, stopped with SIGTERM, must exit 0. Every other
command must exit 0. A TOML block after `<!-- file: NAME -->` is written to NAME first. A block after
`<!-- not-run: REASON -->` is counted and reported, not run; one after `<!-- slow -->` (minutes of training) runs in
full only with EDGEFL_FULL set, and otherwise its edgefl commands are parsed and their configuration validated,
so the suite stays within its ten minutes.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import socket
import stat
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from edgefl_testkit.basics import full_size, in_ci
from edgefl_testkit.mqtt import require_mosquitto
from server.broker import free_port

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
LINKED = ("examples", "firmware_scripts", "scripts")
SERVING = {("edge-server", "broker"), ("edge-server", "run"), ("edge-client", "run")}
ROUNDS = 1
TIMEOUT = 600.0

pytestmark = pytest.mark.integration


@dataclass
class Block:
    path: Path
    line: int
    lang: str
    text: str
    marker: str  # "", "not-run: why", "slow", "file: NAME"

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(REPO)}:{self.line}"


@dataclass
class Section:
    path: Path
    heading: str
    blocks: list[Block] = field(default_factory=list)

    @property
    def id(self) -> str:
        return f"{self.path.name}#{self.heading}"


FENCE = re.compile(r"^( *)```(\w*)\s*$")
MARKER = re.compile(r"^\s*<!--\s*((?:not-run|file):.*?|slow)\s*-->\s*$")


def guides() -> list[Path]:
    """The README and every docs/*.md it links."""
    linked = re.findall(r"\]\((docs/[\w.-]+\.md)\)", README.read_text())
    return [README, *sorted({REPO / p for p in linked})]


def sections(path: Path) -> list[Section]:
    """The fenced blocks of a Markdown file, grouped by the heading they are under."""
    lines = path.read_text().splitlines()
    out = [Section(path, "top")]
    i = 0
    while i < len(lines):
        if lines[i].startswith("#") and re.match(r"^#{1,4} ", lines[i]):
            out.append(Section(path, re.sub(r"[^\w-]+", "-", lines[i].lstrip("# ").strip()).strip("-").lower()))
        fence = FENCE.match(lines[i])
        if fence:
            start, indent = i, len(fence.group(1))
            i += 1
            while not FENCE.match(lines[i]):
                i += 1
            body = "\n".join(line[indent:] for line in lines[start + 1 : i])
            before = next((lines[j] for j in range(start - 1, -1, -1) if lines[j].strip()), "")
            marker = MARKER.match(before)
            out[-1].blocks.append(Block(path, start + 1, fence.group(2), body, marker.group(1) if marker else ""))
        i += 1
    return [s for s in out if any(b.lang in ("bash", "sh", "shell") for b in s.blocks)]


ALL = [s for path in guides() for s in sections(path)]
SHELL = [b for s in ALL for b in s.blocks if b.lang in ("bash", "sh", "shell")]


def commands(text: str) -> list[str]:
    """The block's commands: continuation lines joined, comments and blank lines dropped."""
    joined = re.sub(r"\s*\\\n\s*", " ", text)
    out = []
    for line in joined.splitlines():
        line = re.sub(r"(^|\s)#[^'\"]*$", "", line).strip()  # a trailing comment (no quote after its #)
        if line:
            out.append(line)
    return out


def program(argv: list[str]) -> tuple[str, str]:
    """(program, subcommand) of a command line, past its environment assignments."""
    words = [w for w in argv if not re.match(r"^\w+=", w)] or [""]
    name = Path(words[0]).name
    if name == "python" and words[1:3] == ["-m", "benchmarks.fleet"]:
        return "benchmarks.fleet", ""
    sub = next((w for w in words[1:] if not w.startswith("-")), "")
    return name, sub


class Scratch:
    """The section's directory, its substitutions and the programs it started."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.ports: dict[str, int] = {}
        self.background: list[tuple[str, tuple[str, str], subprocess.Popen, Path]] = []
        self.credentials: Path | None = None
        bin_dir = root / ".venv" / "bin"
        bin_dir.mkdir(parents=True)
        for name, target in (("edge-server", "-m server.cli"), ("edge-client", "-m edge_client.cli"), ("python", "")):
            wrapper = bin_dir / name
            wrapper.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} {target} "$@"\n')
            wrapper.chmod(wrapper.stat().st_mode | stat.S_IEXEC)
        for name in LINKED:
            (root / name).symlink_to(REPO / name)
        self.env = {
            **os.environ,
            "PATH": f"{bin_dir}:{os.environ['PATH']}",
            "PYTHONPATH": str(REPO),
            "COLUMNS": "120",
        }

    def substitute(self, line: str) -> str:
        line = re.sub(r"(^|[\s;&|(])sudo ", r"\1", line)
        line = re.sub(r"\b(SERVER|broker\.lan|0\.0\.0\.0)\b", "127.0.0.1", line)
        for port in re.findall(r"(?:--port |://[\w.-]+:)(\d{4,5})\b", line):
            self.ports.setdefault(port, free_port())
        for port, free in self.ports.items():
            line = re.sub(rf"(--port |://[\w.-]+:){port}\b", rf"\g<1>{free}", line)
        line = re.sub(r"(?<![\w./-])/(etc|var|opt)/", rf"{self.root}/\1/", line)
        line = re.sub(r"<([\w.-]+) password>", lambda m: shlex.quote(self.password(m.group(1), line)), line)
        name, sub = program(shlex.split(line))
        if (name, sub) in (("edge-server", "run"), ("edge-server", "simulate"), ("edge-server", "bench")) or (
            name == "benchmarks.fleet"
        ):
            line = re.sub(r"--rounds \d+", f"--rounds {ROUNDS}", line)
            if "--rounds" not in line:
                line += f" --rounds {ROUNDS}"
        return line

    def password(self, who: str, line: str) -> str:
        import json

        assert self.credentials is not None, f"{line}: no broker of this section wrote credentials.json"
        creds = json.loads(self.credentials.read_text())
        if who == "server":
            return creds["server"]["password"]
        if who == "its":
            who = re.search(r"--client-id (\S+)", line).group(1)  # type: ignore[union-attr]
        return creds["devices"][who]["password"]

    def run(self, block: Block, line: str) -> None:
        argv = shlex.split(line)
        name, sub = program(argv)
        log = self.root / f"cmd-{len(self.background)}-{time.monotonic_ns()}.log"
        if (name, sub) in SERVING and "--once" not in argv and "--max-rounds" not in argv:
            with log.open("w") as out:
                proc = subprocess.Popen(
                    ["bash", "-c", line], cwd=self.root, env=self.env, stdout=out, stderr=subprocess.STDOUT
                )
            self.background.append((f"{block.where}: {line}", (name, sub), proc, log))
            if sub == "broker":
                self._wait_for_broker(argv, proc, log)
            return
        result = subprocess.run(
            ["bash", "-c", line], cwd=self.root, env=self.env, capture_output=True, text=True, timeout=TIMEOUT
        )
        output = f"{tail(result.stdout)}\n{tail(result.stderr)}"
        assert result.returncode == 0, f"{block.where}: `{line}` exited {result.returncode}:\n{output}"

    def _wait_for_broker(self, argv: list[str], proc: subprocess.Popen, log: Path) -> None:
        directory = self.root / argv[argv.index("--dir") + 1]
        port = int(argv[argv.index("--port") + 1]) if "--port" in argv else None
        deadline = time.monotonic() + 60
        while not (directory / "credentials.json").exists() or (port and not _listening(port)):
            assert proc.poll() is None, f"the broker exited {proc.returncode}:\n{tail(log.read_text())}"
            assert time.monotonic() < deadline, f"the broker did not start:\n{tail(log.read_text())}"
            time.sleep(0.1)
        self.credentials = directory / "credentials.json"

    def finish(self) -> None:
        """Every server run ends by itself with status 0; the others, still running, stop on SIGTERM with 0."""
        for what, started, proc, log in self.background:
            if started == ("edge-server", "run"):
                try:
                    code = proc.wait(timeout=TIMEOUT)
                except subprocess.TimeoutExpired:
                    code = None
                assert code == 0, f"{what} ended with {code}:\n{tail(log.read_text())}"
            else:
                assert proc.poll() is None, f"{what} exited {proc.returncode} early:\n{tail(log.read_text())}"
        for what, code, log in self.stop():
            assert code == 0, f"{what} exited {code} on SIGTERM:\n{tail(log.read_text())}"

    def stop(self) -> list[tuple[str, int, Path]]:
        """SIGTERM to what still runs, newest first (devices before their broker); what each exited with."""
        running = [(what, proc, log) for what, _, proc, log in reversed(self.background) if proc.poll() is None]
        for _, proc, _ in running:
            proc.send_signal(signal.SIGTERM)
        out = []
        for what, proc, log in running:
            try:
                out.append((what, proc.wait(timeout=60), log))
            except subprocess.TimeoutExpired:
                proc.kill()
                out.append((what, proc.wait(), log))
        return out


def _listening(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False


def tail(text: str, lines: int = 40) -> str:
    return "\n".join(text.splitlines()[-lines:])


def check_only(line: str, where: Path) -> None:
    """Under CI a slow block's edgefl commands are parsed and their configuration validated (in ``where``, the
    scratch directory), not run."""
    from benchmarks.fleet import build_parser as fleet_parser
    from edge_client.cli import build_parser as client_parser
    from server.cli import _config
    from server.cli import build_parser as server_parser

    argv = [w for w in shlex.split(line) if not re.match(r"^\w+=", w)]
    name, _ = program(argv)
    before = Path.cwd()
    os.chdir(where)
    try:
        if name == "edge-server":
            args = server_parser().parse_args(argv[1:])
            if hasattr(args, "config") and any("__" in k for k in vars(args)):
                _config(args)
        elif name == "edge-client":
            client_parser().parse_args(argv[1:])
        elif name == "benchmarks.fleet":
            fleet_parser().parse_args(argv[3:])
    finally:
        os.chdir(before)


RUNNABLE = [s for s in ALL if any(b.marker in ("", "slow") for b in s.blocks if b.lang in ("bash", "sh", "shell"))]


@pytest.mark.parametrize(
    "section",
    [
        pytest.param(s, id=s.id, marks=[pytest.mark.slow] if any(b.marker == "slow" for b in s.blocks) else [])
        for s in RUNNABLE
    ],
)
def test_the_commands_of_a_guide_section_run(section: Section, tmp_path: Path) -> None:
    require_mosquitto()
    if os.geteuid() != 0 and any("sudo " in b.text for b in section.blocks if not b.marker):
        if in_ci():
            pytest.fail(f"{section.id} runs commands the guide gives with sudo: run the suite as root")
        pytest.skip("the guide runs these with sudo: needs root")
    scratch = Scratch(tmp_path)
    try:
        for block in section.blocks:
            if block.marker.startswith("file:"):
                (tmp_path / block.marker.split(":", 1)[1].strip()).write_text(block.text + "\n")
            if block.lang not in ("bash", "sh", "shell") or block.marker.startswith("not-run"):
                continue
            for line in commands(block.text):
                if block.marker == "slow" and not full_size():
                    check_only(scratch.substitute(re.sub(r"<[\w.-]+ password>", "unused", line)), tmp_path)
                else:
                    scratch.run(block, scratch.substitute(line))
    except BaseException:
        scratch.stop()  # the failure is the one to report
        raise
    scratch.finish()


def test_every_block_that_does_not_run_says_why() -> None:
    """Counted and reported: the blocks marked not-run, each with its reason; the others run above."""
    assert SHELL, "no shell blocks found in the README and its guides"
    skipped = [b for b in SHELL if b.marker.startswith("not-run")]
    for block in skipped:
        assert block.marker.split(":", 1)[1].strip(), f"{block.where}: not-run needs a reason"
    runs = len(SHELL) - len(skipped)
    report = "; ".join(f"{b.where} ({b.marker.split(':', 1)[1].strip()})" for b in skipped)
    warnings.warn(f"docs commands: {runs} of {len(SHELL)} shell blocks run; not run: {report}", stacklevel=1)
    assert runs >= len(SHELL) // 3, "most of the guides' command blocks must run"


def test_the_block_reader_joins_lines_drops_comments_and_substitutes(tmp_path: Path) -> None:
    text = "# a comment\n.venv/bin/edge-server run --config x.toml \\\n    --broker mqtts://SERVER:8884  # note\n"
    assert commands(text) == [".venv/bin/edge-server run --config x.toml --broker mqtts://SERVER:8884"]
    scratch = Scratch(tmp_path)
    line = scratch.substitute(commands(text)[0] + " --ca-file /etc/mosquitto/edgefl/ca.crt")
    port = scratch.ports["8884"]
    assert f"--broker mqtts://127.0.0.1:{port} --ca-file {tmp_path}/etc/mosquitto/edgefl/ca.crt" in line
    assert line.endswith(f"--rounds {ROUNDS}")
    assert scratch.substitute("sudo firmware_scripts/x.sh --port 8884") == f"firmware_scripts/x.sh --port {port}"
