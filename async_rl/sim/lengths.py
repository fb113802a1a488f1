"""Response-length distributions for the simulator: a run's own lengths, or a parametric long tail.

    dist = LengthDist(kind="lognormal", mean=8000, sigma=0.9, max=27648)
    draw = dist.sampler(np.random.default_rng(0))
    draw()           # one response length in tokens, in [1, max]

- `constant`: every response is `value` tokens (closed-form checks).
- `empirical`: drawn with replacement from `samples` (what `async-rl sim calibrate` reads from a
  run's `train/response_lens`).
- `sequence`: `samples` in their order, over again when they run out: a measured run replayed with
  the lengths it trained, in the order it trained them (a policy that learns changes its lengths as
  it goes; drawing them at random would lose that).
- `lognormal`: the long tail of reasoning rollouts; `mean` is the mean before truncation at `max`,
  `sigma` the log-space spread. Lengths above `max` are cut to `max` (the `length` finish).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

KINDS = ("constant", "empirical", "sequence", "lognormal")


@dataclass
class LengthDist:
    kind: str = "constant"  # constant | empirical | sequence | lognormal
    value: int = 1  # constant: every length
    samples: list[int] = field(default_factory=list)  # empirical: drawn with replacement; sequence: in order
    mean: float = 0.0  # lognormal: mean before truncation at `max`
    sigma: float = 1.0  # lognormal: spread in log space
    max: int = 0  # longest response (max_new_tokens); 0 = no cap

    def validate(self, key: str = "response") -> None:
        if self.kind not in KINDS:
            raise ValueError(f"{key}.kind: must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if self.kind == "constant" and self.value < 1:
            raise ValueError(f"{key}.value: must be >= 1, got {self.value}")
        if self.kind in ("empirical", "sequence") and (not self.samples or min(self.samples) < 0):
            raise ValueError(f"{key}.samples: needs at least one length, none negative")
        if self.kind == "lognormal" and (self.mean <= 0 or self.sigma <= 0):
            raise ValueError(f"{key}.mean, {key}.sigma: must be > 0, got {self.mean}, {self.sigma}")
        if self.max < 0:
            raise ValueError(f"{key}.max: must be >= 0, got {self.max}")

    def sampler(self, rng: np.random.Generator) -> Callable[[], int]:
        cap = self.max or 1 << 62
        if self.kind == "constant":
            value = max(1, min(self.value, cap))
            return lambda: value
        if self.kind in ("empirical", "sequence"):
            pool = np.maximum(1, np.minimum(np.asarray(self.samples, dtype=np.int64), cap))
            if self.kind == "sequence":
                order = itertools.cycle(pool.tolist())
                return lambda: next(order)
            return lambda: int(pool[rng.integers(len(pool))])
        mu = math.log(self.mean) - self.sigma ** 2 / 2  # so that E[length] = mean before the cap
        return lambda: int(max(1, min(cap, round(rng.lognormal(mu, self.sigma)))))

    def mean_length(self, rng_seed: int = 0, n: int = 20000) -> float:
        """Mean response length after the cap (estimated by drawing for the lognormal)."""
        draw = self.sampler(np.random.default_rng(rng_seed))
        if self.kind == "constant":
            return float(draw())
        if self.kind in ("empirical", "sequence"):
            cap = self.max or 1 << 62
            return float(np.mean(np.maximum(1, np.minimum(self.samples, cap))))
        return float(np.mean([draw() for _ in range(n)]))
