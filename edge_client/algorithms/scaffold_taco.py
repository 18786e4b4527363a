"""TACO-tailored SCAFFOLD client half (ALGORITHMS.md 2.7 (f)13): SCAFFOLD's client unchanged.

The server sends each client its own coefficient ``1 - alpha_i`` as params["alpha"], which SCAFFOLD's client already
reads every round; only the algorithm name differs (its ``c_i`` state is kept under this name's state file). So is
the commit of ``c_i^new`` only once the server's next assignment says it aggregated that round (scaffold.py).
"""

from __future__ import annotations

from edge_client.algorithms.scaffold import ScaffoldClient


class ScaffoldTacoClient(ScaffoldClient):
    name = "scaffold-taco"
