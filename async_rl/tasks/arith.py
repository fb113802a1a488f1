"""Arithmetic problems with an exact-answer reward.

Operands are drawn uniformly from [min_operand, max_operand]; training problems come
from a stream seeded by the run's seed, the fixed held-out set from `task.eval_seed`
(with small operand ranges the two necessarily share problems).
"""

from __future__ import annotations

import operator
import random
from collections.abc import Iterator

from async_rl.config import TaskConfig
from async_rl.rewards.math import exact_number_reward
from async_rl.types import Sample

_OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul}
CHAT_QUESTION = "What is {a} {op} {b}? Answer with just the number."


class ArithTask:
    """Problems like "23+45=" (raw) or "What is 23 + 45? ..." (chat), reward = exact answer."""

    def __init__(self, cfg: TaskConfig):
        unknown = [op for op in cfg.ops if op not in _OPS]
        if unknown or not cfg.ops:
            raise ValueError(f"task.ops: unknown operator(s) {unknown or cfg.ops}; allowed: {sorted(_OPS)}")
        self.cfg = cfg

    def _make(self, rng: random.Random, idx: str) -> Sample:
        a = rng.randint(self.cfg.min_operand, self.cfg.max_operand)
        b = rng.randint(self.cfg.min_operand, self.cfg.max_operand)
        op = rng.choice(self.cfg.ops)
        answer = str(_OPS[op](a, b))
        info = {"a": a, "b": b, "op": op}
        if self.cfg.prompt_format == "chat":
            question = CHAT_QUESTION.format(a=a, op=op, b=b)
            return Sample(id=idx, messages=[{"role": "user", "content": question}], answer=answer, info=info)
        return Sample(id=idx, prompt=f"{a}{op}{b}=", answer=answer, info=info)

    def train_samples(self, seed: int) -> Iterator[Sample]:
        rng = random.Random(seed)
        i = 0
        while True:
            yield self._make(rng, f"train-{i}")
            i += 1

    def eval_samples(self) -> list[Sample]:
        rng = random.Random(self.cfg.eval_seed)
        return [self._make(rng, f"eval-{i}") for i in range(self.cfg.eval_size)]

    def reward(self, sample: Sample, response_text: str) -> float:
        return exact_number_reward(response_text, sample.answer, self.cfg.answer_pick)
