"""A train step's statistics, gathered over its micro-batches (and, in a data-parallel backend,
combined over ranks): weighted means, maxima, per-minibatch totals, gradient norms.

    acc = StatsAccumulator()
    acc.add({"clip_frac": 0.1, "behav_weight_max": 1.3}, weight=120)   # measured on 120 tokens
    acc.add_total("loss", 0.42)                                         # a part of this minibatch's loss
    acc.add_grad_norm(0.9)                                              # one per optimizer step
    acc.result()  # {"train/clip_frac": ..., "train/behav_weight_max": ..., "train/loss": ..., "train/grad_norm": ...}
"""

from __future__ import annotations

import math

import numpy as np


class StatsAccumulator:
    """Stats of a step's micro-batches, prefixed `train/`: weighted means (each `add` says how many
    tokens its stats were measured on), maxima for `*_max` keys, and totals per minibatch (a
    minibatch's loss is the sum of its micro-batches' parts) averaged over the minibatches."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = {}
        self.weights: dict[str, float] = {}
        self.maxes: dict[str, float] = {}
        self.totals: dict[str, float] = {}
        self.norms: list[float] = []

    def add(self, stats: dict[str, float], weight: int) -> None:
        for key, value in stats.items():
            if key.endswith("_max"):
                self.maxes[key] = max(self.maxes.get(key, -math.inf), value)
            else:
                self.sums[key] = self.sums.get(key, 0.0) + value * weight
                self.weights[key] = self.weights.get(key, 0.0) + weight

    def add_total(self, key: str, value: float) -> None:
        self.totals[key] = self.totals.get(key, 0.0) + value

    def add_grad_norm(self, norm: float) -> None:
        self.norms.append(norm)

    def result(self) -> dict[str, float]:
        out = {f"train/{k}": v / self.weights[k] if self.weights[k] else 0.0 for k, v in self.sums.items()}
        out.update({f"train/{k}": v for k, v in self.maxes.items()})
        out.update({f"train/{k}": v / max(1, len(self.norms)) for k, v in self.totals.items()})
        out["train/grad_norm"] = float(np.mean(self.norms)) if self.norms else 0.0
        return out
