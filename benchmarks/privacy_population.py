"""Benchmark (issue 27, beyond its 100 devices): what a privacy budget costs in a population where DP-FedAvg can learn.
FedAvg on MNIST (IID), 6000 devices of 10 samples each, each selected with probability 0.05 a round (300 expected),
30 rounds of 10 local steps at lr 0.1, in-process; epsilon 1, 3 and 8 (delta 1e-5, fixed clipping at norm 1) and
without DP. The issue's 100-device benchmark (``benchmarks.privacy``) cannot learn under any useful epsilon: the
noise on the mean falls as 1 / (devices a round), so this is the scale at which the budget buys a model.

    python -m benchmarks.privacy_population [--quick] [--out DIR] [--runs DIR] [benchmarks.privacy's options]

Results: ``<out>/privacy_population.json``, ``.md`` and ``.png`` (accuracy against epsilon). Quick (CI): digits, 100
devices at rate 0.25, 2 rounds of 5 steps, epsilon 8 and no DP.
"""

from __future__ import annotations

import sys

from benchmarks import privacy

NAME = "privacy_population"
POPULATION = {"devices": 6000, "fraction": 0.05, "rounds": 30, "local_steps": 10, "lr": 0.1, "partitions": "iid",
              "epsilons": "1,3,8", "adaptive": False}  # fmt: skip
QUICK = {**privacy.QUICK, "devices": 100}  # 25 a round; delta 1e-3 stays below 1 / 100


def main(argv: list[str] | None = None) -> int:
    parser = privacy.build_parser(f"python -m benchmarks.{NAME}", __doc__, QUICK)
    parser.set_defaults(**POPULATION)
    data = privacy.run(parser.parse_args(argv), NAME, QUICK)
    print(privacy.markdown(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
