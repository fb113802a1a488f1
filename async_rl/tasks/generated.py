"""What generated tasks share: a seeded stream of training samples, a fixed held-out set, and
agent / interaction names cycled per prompt (`task.agents`, `task.interactions`)."""

from __future__ import annotations

import abc
import random
from collections.abc import Iterator
from typing import Any

from async_rl.config import TaskConfig
from async_rl.types import Sample


def cycled(names: list[str], i: int, default: str | None) -> str | None:
    """The i-th name of a list cycled per prompt, or the default when the list is empty."""
    return names[i % len(names)] if names else default


class GeneratedTask(abc.ABC):
    """Subclasses implement `_make(rng, sample_id, index)`; training draws from the run's seed, the
    held-out set from `task.eval_seed`. A sample names its agent loop (`agent_for`) and, where the
    task or `task.interactions` names one, its simulated user (`interaction_for`)."""

    default_agent: str | None = None  # None: the run's `rollout.agent`
    default_interaction: str | None = None  # None: no simulated user unless `task.interactions` names one

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

    def agent_for(self, i: int) -> str | None:
        return cycled(self.cfg.agents, i, self.default_agent)

    def interaction_for(self, i: int, **kwargs: Any) -> dict[str, Any]:
        """The sample-info entries naming the i-th prompt's interaction and its kwargs ({} = none)."""
        name = cycled(self.cfg.interactions, i, self.default_interaction)
        return {"interaction": name, "interaction_kwargs": kwargs} if name else {}

    def names_used(self) -> dict[str, dict[str, list[str]]]:
        """The agent loops and interactions this task's samples name, each under what chose it (the
        config key, or the task's own default), checked against the registries before a run starts:
        {"agents": {source: names}, "interactions": {source: names}}."""
        default = f"task.name={self.cfg.name}'s default"
        used: dict[str, dict[str, list[str]]] = {}
        for kind, names, fallback in (("agents", self.cfg.agents, self.default_agent),
                                      ("interactions", self.cfg.interactions, self.default_interaction)):
            used[kind] = {f"task.{kind}": list(names)} if names else ({default: [fallback]} if fallback else {})
        return used
