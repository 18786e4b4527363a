"""The rooms of the code base and what each may import (docs/architecture.md's table), read from the sources with ast.

- Every module of ``edge_client`` and ``server`` imports.
- No import circle among the modules' top-level imports (``if TYPE_CHECKING:`` blocks included: a circle of types is
  still a circle), and no import inside a function that would close one (a deferred import dodging a circle).
- Each room imports only the rooms it may: ``edge_client`` never ``server``; inside ``edge_client`` the wire and
  learning build on no other room, the algorithms on those two, the device loop on those three (and secagg), the
  tools on anything; the server's runtime never ``server.experiments`` (``edge-server run`` serves real devices
  without it), except the commands of ``server/cli.py`` that run experiments, inside their own functions.
- ``edge_client``'s top level holds its rooms and the command alone, so a new module has to choose its room.
- A third-party module imported inside a function is one of ``DEFERRED``, each saying why it is not at the top.
"""

from __future__ import annotations

import ast
import importlib
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("edge_client", "server")


def device_room_never(*rooms: str) -> tuple[str, ...]:
    """What a room of ``edge_client`` must never import: ``server``, and these rooms of its own package."""
    return ("server", *(f"edge_client.{r}" for r in rooms))


#: room -> the rooms it must never import (a module's room: the longest name here its own starts with)
FORBIDDEN: dict[str, tuple[str, ...]] = {
    # the device package: its command (cli.py, exits.py) may use every room; the server imports the rooms
    "edge_client": ("server",),
    # what crosses MQTT: both halves speak through it, so it builds on nothing of the device (secagg's sizes only)
    "edge_client.wire": device_room_never("learning", "algorithms", "loop", "tools"),
    # secure aggregation's device half: its own messages (the wire), nothing of the device's training
    "edge_client.secagg": device_room_never("learning", "algorithms", "loop", "tools"),
    # models, tasks, data: built alike by the server and by every device, knowing nothing of how they travel
    "edge_client.learning": device_room_never("wire", "secagg", "algorithms", "loop", "tools"),
    # each algorithm's client half and contract: on the wire's plan and facts, learning's flat model and data
    "edge_client.algorithms": device_room_never("secagg", "loop", "tools"),
    # the device loop: on every room above, never on the tools that drive it
    "edge_client.loop": device_room_never("tools"),
    "edge_client.tools": device_room_never(),  # check, benchmark, fetch-model: anything of edge_client
    "server": ("server.experiments",),  # the runtime: edge-server run, its config, strategies, dashboard
    "server.experiments": (),  # simulation and bench: anything above
}
#: what sits at edge_client's top level besides the rooms: the edge-client command and its exit statuses
COMMAND = {"cli", "exits"}
#: module -> a room it may import inside its functions only: the commands that are that room's door
DOORS = {"server.cli": "server.experiments"}  # edge-server simulate, bench

#: third-party modules imported inside functions, and why not at the top of the module
DEFERRED = {
    "torch": "heavy: edge-client predict and fetch run on onnxruntime without it, and check imports it in a probe "
    "subprocess (a wheel dying with SIGILL fails its own line)",
    "onnxruntime": "imported by its users only: check probes it in a subprocess, the predictor loads it on first use",
    "onnxscript": "optional: only torch's dynamo ONNX exporter needs it, tried when the TorchScript one fails",
    "numpy": "edge-client check imports what each item checks (a broken wheel fails its own line); predict loads it "
    "after parsing its arguments",
    "psutil": "edge-client check's device item imports what it checks",
    "rich": "the server extra's console: tables and logging handler of the commands that print them",
    "zarr": "optional (server extra): only the mnist data set needs it; without it, DatasetNotInstalled says what "
    "to install",
    "sklearn": "optional (server extra): only the digits data set needs it",
    "dp_accounting": "imported when a run uses DP: the library takes seconds to import, which every run would pay",
}


@dataclass(frozen=True)
class Import:
    importer: str
    imported: str  # a module of PACKAGES, or a third-party / standard module's top-level name
    line: int
    deferred: bool  # inside a function


def module_names() -> dict[str, Path]:
    """Every module of PACKAGES by its dotted name (a package by its own name)."""
    out = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


MODULES = module_names()


def _targets(node: ast.Import | ast.ImportFrom, importer: str) -> Iterator[str]:
    """The modules an import statement names: ``from a.b import c`` is ``a.b.c`` when that is a module, else ``a.b``."""
    if isinstance(node, ast.Import):
        for alias in node.names:
            yield alias.name if alias.name.split(".")[0] in PACKAGES else alias.name.split(".")[0]
        return
    base = node.module or ""
    if node.level:  # relative: from the importer's package
        package = importer.split(".") if MODULES[importer].name == "__init__.py" else importer.split(".")[:-1]
        base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
    if base.split(".")[0] not in PACKAGES:
        yield base.split(".")[0]
        return
    for alias in node.names:
        yield f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base


def imports_of(name: str) -> list[Import]:
    tree = ast.parse(MODULES[name].read_text(), str(MODULES[name]))
    out: list[Import] = []

    def visit(node: ast.AST, deferred: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import | ast.ImportFrom):
                out.extend(Import(name, t, child.lineno, deferred) for t in _targets(child, name))
            visit(child, deferred or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef))

    visit(tree, False)
    return out


IMPORTS = [i for name in MODULES for i in imports_of(name)]
OURS = [i for i in IMPORTS if i.imported in MODULES]


def top_level_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {name: set() for name in MODULES}
    for i in OURS:
        if not i.deferred and i.imported != i.importer:
            graph[i.importer].add(i.imported)
    return graph


def reaches(graph: dict[str, set[str]], start: str, goal: str) -> list[str] | None:
    """A path of imports from ``start`` to ``goal``, or None."""
    seen, stack = {start}, [[start]]
    while stack:
        path = stack.pop()
        for nxt in sorted(graph[path[-1]]):
            if nxt == goal:
                return [*path, nxt]
            if nxt not in seen:
                seen.add(nxt)
                stack.append([*path, nxt])
    return None


def room(name: str) -> str:
    return max((r for r in FORBIDDEN if name == r or name.startswith(r + ".")), key=len)


def test_every_module_imports() -> None:
    failed = {}
    for name in MODULES:
        try:
            importlib.import_module(name)
        except Exception as exc:  # every failure reported at once, by module
            failed[name] = repr(exc)
    assert not failed, failed
    assert all(name in sys.modules for name in MODULES)


def test_no_import_circle() -> None:
    graph = top_level_graph()
    circles = {}
    for i in OURS:
        if i.deferred or i.imported == i.importer:
            continue
        back = reaches(graph, i.imported, i.importer)
        if back:
            circles[f"{i.importer}:{i.line}"] = " -> ".join([i.importer, *back])
    assert not circles, f"import circles (move what both sides need into a module both import): {circles}"


def test_no_deferred_import_dodges_a_circle() -> None:
    graph = top_level_graph()
    dodges = {
        f"{i.importer}:{i.line} imports {i.imported}": " -> ".join(path)
        for i in OURS
        if i.deferred and (path := reaches(graph, i.imported, i.importer))
    }
    assert not dodges, f"imports inside functions that hide a circle (break the circle instead): {dodges}"


def test_each_room_imports_only_what_it_may() -> None:
    trespass: set[str] = set()
    for i in OURS:
        for banned in FORBIDDEN[room(i.importer)]:
            if room(i.imported) == banned or i.imported.startswith(banned + "."):
                door = i.deferred and DOORS.get(i.importer) == banned
                if not door:
                    trespass.add(f"{i.importer}:{i.line} imports {i.imported}")
    assert not trespass, f"imports across rooms (docs/architecture.md: what each room may import): {sorted(trespass)}"


def test_edge_client_top_level_holds_the_rooms_and_the_command() -> None:
    rooms = {r.removeprefix("edge_client.") for r in FORBIDDEN if r.startswith("edge_client.")}
    top = {name.split(".")[1] for name in MODULES if name.startswith("edge_client.")}
    stray = top - rooms - COMMAND
    assert not stray, f"edge_client modules outside a room (move each into the room that holds its kind): {stray}"


def test_third_party_imports_inside_functions_are_documented() -> None:
    undocumented = sorted(
        f"{i.importer}:{i.line} imports {i.imported}"
        for i in IMPORTS
        if i.deferred and i.imported not in MODULES and i.imported not in DEFERRED
    )
    assert not undocumented, f"import these at the top of the module, or say in DEFERRED why not: {undocumented}"
    unused = set(DEFERRED) - {i.imported for i in IMPORTS if i.deferred}
    assert not unused, f"no module defers these any more: remove them from DEFERRED: {unused}"


@pytest.mark.parametrize(
    ("source", "found"),
    [
        ("import server.config\n", "server.config"),
        ("from server import device_profiles\n", "server.device_profiles"),
        ("from server.config import RunConfig\n", "server.config"),
        ("from edge_client.algorithms import contract_of\n", "edge_client.algorithms"),
        ("import torch.onnx\n", "torch"),
    ],
)
def test_import_targets_are_resolved_to_modules(source: str, found: str) -> None:
    [node] = ast.parse(source).body
    assert isinstance(node, ast.Import | ast.ImportFrom)
    assert list(_targets(node, "server.cli")) == [found]
