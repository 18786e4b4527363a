"""The rooms of tests/ (docs/architecture.md#tests), read from the test files with ast: a unit test starts nothing.

The real mosquitto and the federations of client processes are fixtures of tests/integration/conftest.py, so a unit
test cannot ask for them; this checks the other ways in. A file under tests/unit/ carries no ``integration`` mark,
calls none of the helpers that start a broker or client processes, and runs no command of this project
(``python -m server.cli ...``) in a process. A fresh interpreter that observes one module (what it imports, its own
memory) is still a unit test.
"""

from __future__ import annotations

import ast
import itertools
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]
UNIT = TESTS / "unit"
#: helpers of edgefl_testkit (and the server) that start a broker, client processes or a benchmark
STARTERS = {"require_mosquitto", "start_federation", "start_clients", "run_processes", "over_mqtt", "Broker",
            "run_benchmark_quick"}  # fmt: skip


def is_command(module: str) -> bool:
    """One of this project's commands, as ``python -m MODULE`` runs it."""
    return module in ("server.cli", "edge_client.cli") or module.startswith("benchmarks.")


def trespasses(source: str) -> list[str]:
    """What in a test file's source belongs in tests/integration/, by line."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr == "integration":
            found.append(f"{node.lineno}: the integration mark")
        elif isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
            if name in STARTERS:
                found.append(f"{node.lineno}: {name}(...) starts a broker or client processes")
        elif isinstance(node, ast.List | ast.Tuple):  # an argv: [..., "-m", "server.cli", ...]
            words = [e.value if isinstance(e, ast.Constant) else None for e in node.elts]
            for flag, module in itertools.pairwise(words):
                if flag == "-m" and isinstance(module, str) and is_command(module):
                    found.append(f"{node.lineno}: runs `python -m {module}` in a process")
    return found


def test_no_unit_test_starts_a_broker_client_processes_or_a_command() -> None:
    wrong = {
        str(path.relative_to(TESTS)): hits
        for path in sorted(UNIT.rglob("*.py"))
        if path != Path(__file__).resolve() and (hits := trespasses(path.read_text()))
    }
    assert not wrong, f"these belong in tests/integration/ (docs/architecture.md#tests): {wrong}"


@pytest.mark.parametrize(
    ("source", "caught"),
    [
        ("@pytest.mark.integration\ndef test_x(): pass\n", True),
        ("pytestmark = pytest.mark.integration\n", True),
        ("def test_x(broker):\n    FakeDevice.over_mqtt(broker.url)\n", True),
        ("def test_x():\n    start_federation(tmp, link)\n", True),
        ("def test_x():\n    Broker(tmp, settings).start()\n", True),
        ("def test_x():\n    subprocess.run([sys.executable, '-m', 'server.cli', 'simulate'])\n", True),
        ("def test_x():\n    run([sys.executable, '-m', 'benchmarks.privacy', '--quick'])\n", True),
        ("from server.cli import build_parser\n\ndef test_x():\n    build_parser()\n", False),
        ("def test_x():\n    subprocess.run([sys.executable, '-c', 'import edge_client.learning.predictor'])\n", False),
        ("def test_x():\n    run_simulated('inprocess', config, bundle, None)\n", False),
        ('DOORS = {"server.cli": "server.experiments"}\n', False),
    ],
)
def test_the_rule_tells_a_unit_from_an_integration_test(source: str, caught: bool) -> None:
    assert bool(trespasses(source)) == caught, trespasses(source)
