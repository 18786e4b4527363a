"""One device's share of a combined value, capped (``clients.max_weight_share``).

Sample counts come from the devices: a device registering 10^7 samples (or declaring a held-out split that large)
would otherwise decide every sample-weighted aggregate and every combined evaluation alone. The cap is applied once,
to the counts, before anything is combined: the largest counts are lowered to one common value ``c`` such that no
device holds more than ``share`` of the capped total (water-filling), and every count below ``c`` is left as it is,
so an honest fleet whose shards differ moderately keeps its exact data-size weights. With fewer than ``1 / share``
devices no such ``c`` exists and the devices are weighted equally (the least one device can hold).
"""

from __future__ import annotations

import math
from collections.abc import Mapping


def capped_counts(counts: Mapping[str, int], share: float) -> dict[str, int]:
    """``counts`` with the largest lowered so that none is more than ``share`` of their sum (equal when impossible);
    counts stay integers >= 1 (a positive count is never lowered to 0) and zero counts stay 0."""
    positive = sorted((n for n in counts.values() if n > 0), reverse=True)
    if share >= 1.0 or len(positive) < 2 or positive[0] <= share * sum(positive):
        return dict(counts)
    cap = float(positive[-1])  # equal weights, unless a higher common cap satisfies the share
    rest = sum(positive)
    for m in range(1, len(positive)):  # cap the m largest at c: c = share * (m c + rest) with rest the uncapped sum
        rest -= positive[m - 1]
        if share * m >= 1.0:
            break
        c = share * rest / (1.0 - share * m)
        if c >= positive[m]:
            cap = c
            break
    limit = max(1, math.floor(cap))
    return {cid: min(n, limit) for cid, n in counts.items()}
