"""What generated tasks share: a seeded stream of training samples, a held-out set that the stream
never repeats, and agent / interaction names cycled per prompt (`task.agents`, `task.interactions`).

Held out means held out: the test problems are `task.eval_size` distinct problems drawn with
`task.eval_seed`, the validation problems (`task.val_size`) the next distinct ones of the same draw,
and the training stream skips every sample whose prompt is one of either, so no held-out prompt is
ever trained on. The two sets share no problem: validation chooses (the run's best checkpoint,
settings), the test set scores what was chosen. At most a third of a task's problem space is a test
problem (`HELD_OUT_SHARE`), and test and validation together at most half (`WITH_VALIDATION_SHARE`),
so a small space keeps most of its problems for training: the debug task's nine sums (operands
0..2) hold out three, never trained on, and its accuracy measures whether the model generalises to
them. Adding a validation set leaves the test set as it was (the same first draws).
"""

from __future__ import annotations

import abc
import functools
import json
import random
from collections.abc import Iterator
from typing import Any

from async_rl.config import TaskConfig
from async_rl.types import Sample

HELD_OUT_SHARE = 3  # at most 1/HELD_OUT_SHARE of a task's distinct problems are held out for evaluation
WITH_VALIDATION_SHARE = 2  # test and validation problems together: at most 1/WITH_VALIDATION_SHARE of them


def cycled(names: list[str], i: int, default: str | None) -> str | None:
    """The i-th name of a list cycled per prompt, or the default when the list is empty."""
    return names[i % len(names)] if names else default


def prompt_key(sample: Sample) -> str:
    """What makes two samples the same problem for the model: the prompt it is shown."""
    return sample.prompt if sample.prompt is not None else json.dumps(sample.messages, sort_keys=True)


class GeneratedTask(abc.ABC):
    """Subclasses implement `_make(rng, sample_id, index)` and `problem_count()`; training draws from
    the run's seed, skipping the held-out problems (drawn from `task.eval_seed`). A sample names its
    agent loop (`agent_for`) and, where the task or `task.interactions` names one, its simulated user
    (`interaction_for`)."""

    default_agent: str | None = None  # None: the run's `rollout.agent`
    default_interaction: str | None = None  # None: no simulated user unless `task.interactions` names one

    def __init__(self, cfg: TaskConfig):
        self.cfg = cfg
        if self.problem_count() < HELD_OUT_SHARE:
            raise ValueError(f"task.min_operand/max_operand: task {cfg.name!r} can make only {self.problem_count()} "
                             f"distinct problems with operands {cfg.min_operand}..{cfg.max_operand}; at least "
                             f"{HELD_OUT_SHARE} are needed to hold one out for evaluation and train on the rest")

    @abc.abstractmethod
    def _make(self, rng: random.Random, idx: str, i: int) -> Sample:
        ...

    @abc.abstractmethod
    def problem_count(self) -> int:
        """How many distinct problems (prompts) the task's settings can make."""

    @functools.cached_property
    def _held_out(self) -> tuple[tuple[Sample, ...], tuple[Sample, ...], frozenset[str]]:
        """(test samples, validation samples, the prompts of both): one seeded draw of distinct problems,
        the test set first."""
        test = min(self.cfg.eval_size, self.problem_count() // HELD_OUT_SHARE)
        val = max(0, min(self.cfg.val_size, self.problem_count() // WITH_VALIDATION_SHARE - test))
        size = test + val
        rng = random.Random(self.cfg.eval_seed)
        samples: list[Sample] = []
        keys: set[str] = set()
        draws = 0
        while len(samples) < size:
            draws += 1
            if draws > 1000 * size + 1000:  # a few times `size` draws in any space of 2 * size or more
                raise RuntimeError(f"task {self.cfg.name!r}: drew no {size} distinct held-out problems "
                                   f"(problem_count() says {self.problem_count()})")
            i = len(samples)
            sample = self._make(rng, f"eval-{i}" if i < test else f"val-{i - test}", i)
            if prompt_key(sample) not in keys:
                keys.add(prompt_key(sample))
                samples.append(sample)
        return tuple(samples[:test]), tuple(samples[test:]), frozenset(keys)

    def train_samples(self, seed: int) -> Iterator[Sample]:
        """The endless training stream of this seed: every problem but the held-out ones."""
        held_out = self._held_out[2]
        rng = random.Random(seed)
        i = 0
        while True:
            sample = self._make(rng, f"train-{i}", i)
            if prompt_key(sample) not in held_out:
                yield sample
                i += 1

    def eval_samples(self) -> list[Sample]:
        """The test set: `task.eval_size` distinct problems (fewer where a third of the space is fewer)."""
        return list(self._held_out[0])

    def val_samples(self) -> list[Sample]:
        """The validation set: `task.val_size` distinct problems, none in the test set (fewer where test and
        validation would pass half of the space)."""
        return list(self._held_out[1])

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
