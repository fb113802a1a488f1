"""What generated tasks share: a seeded stream of training samples, a fixed held-out set, and
agent / interaction names cycled per prompt (`task.agents`, `task.interactions`)."""

from __future__ import annotations

import abc
import random
from collections.abc import Iterator

from async_rl.config import TaskConfig
from async_rl.types import Sample


def cycled(names: list[str], i: int, default: str) -> str:
    """The i-th name of a list cycled per prompt, or the default when the list is empty."""
    return names[i % len(names)] if names else default


class GeneratedTask(abc.ABC):
    """Subclasses implement `_make(rng, sample_id, index)`; training draws from the run's seed, the
    held-out set from `task.eval_seed`."""

    def __init__(self, cfg: TaskConfig):
        self.cfg = cfg

    @abc.abstractmethod
    def _make(self, rng: random.Random, idx: str, i: int) -> Sample:
        ...

    def train_samples(self, seed: int) -> Iterator[Sample]:
        rng = random.Random(seed)
        i = 0
        while True:
            yield self._make(rng, f"train-{i}", i)
            i += 1

    def eval_samples(self) -> list[Sample]:
        rng = random.Random(self.cfg.eval_seed)
        return [self._make(rng, f"eval-{i}", i) for i in range(self.cfg.eval_size)]
