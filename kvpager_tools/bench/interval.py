"""How far a ratio of two engines' median throughputs can be trusted.

On the shared dev machines the same engine's rounds drift by ±15 % within
an hour (docs/benchmarks.md), so a ratio of medians of five rounds can read
0.94 one run and 1.03 the next with nothing changed. A comparison therefore
reports, beside the ratio, a bootstrap interval: the rounds are resampled
with replacement and the ratio of medians recomputed each time; the
interval is the central ``level`` share of those ratios. Where the rounds
were interleaved (compare-vllm, offline and online: one round of each
engine back to back), whole pairs are resampled, so drift that moves both
rounds of a pair moves both medians together. The resampling is seeded: the same rounds give
the same interval.
"""

from __future__ import annotations

import random
import statistics


def ratio_interval(ours: list[float], theirs: list[float], *, paired: bool, level: float = 0.9,
                   resamples: int = 4000, seed: int = 0) -> dict:
    """Bootstrap interval of ``median(ours) / median(theirs)``.

    ours, theirs: per-round throughputs (higher is better); ``paired``:
    round i of each was taken back to back (then the lists have one length
    and pairs are resampled together). Returns {"level", "method", "low",
    "high"}, the bounds rounded to 3 digits."""
    if not ours or not theirs:
        raise ValueError("ratio_interval needs at least one round of each engine")
    if paired and len(ours) != len(theirs):
        raise ValueError(f"paired rounds need equal counts, got {len(ours)} and {len(theirs)}")
    if not 0.0 < level < 1.0:
        raise ValueError(f"level must be in (0, 1), got {level}")
    if min(theirs) <= 0:
        raise ValueError("throughputs must be positive")
    rng = random.Random(seed)
    ratios = []
    for _ in range(resamples):
        if paired:
            pick = [rng.randrange(len(ours)) for _ in ours]
            a, b = [ours[i] for i in pick], [theirs[i] for i in pick]
        else:
            a = [rng.choice(ours) for _ in ours]
            b = [rng.choice(theirs) for _ in theirs]
        ratios.append(statistics.median(a) / statistics.median(b))
    ratios.sort()
    tail = (1.0 - level) / 2.0
    low = ratios[int(tail * (resamples - 1))]
    high = ratios[int(round((1.0 - tail) * (resamples - 1)))]
    method = "bootstrap of interleaved round pairs" if paired else "bootstrap of each engine's rounds"
    return {"level": level, "method": method, "low": round(low, 3), "high": round(high, 3)}
