"""Arithmetic problems with an exact-answer reward.

Operands are drawn uniformly from [min_operand, max_operand]; training problems come
from a stream seeded by the run's seed, the fixed held-out set from `task.eval_seed`
(with small operand ranges the two necessarily share problems).
"""

from __future__ import annotations

import operator
import random

from async_rl.config import TaskConfig
from async_rl.rewards.math import exact_number_reward
from async_rl.tasks.generated import GeneratedTask
from async_rl.types import Sample

_OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul}
CHAT_QUESTION = "What is {a} {op} {b}? Answer with just the number."


class ArithTask(GeneratedTask):
    """Problems like "23+45=" (raw) or "What is 23 + 45? ..." (chat), reward = exact answer. Samples
    run on `rollout.agent` unless `task.agents` names loops; `task.interactions` adds a simulated
    user that judges the answer (`interaction_kwargs.answer`)."""

    def __init__(self, cfg: TaskConfig):
        unknown = [op for op in cfg.ops if op not in _OPS]
        if unknown or not cfg.ops:
            raise ValueError(f"task.ops: unknown operator(s) {unknown or cfg.ops}; allowed: {sorted(_OPS)}")
        super().__init__(cfg)

    def _make(self, rng: random.Random, idx: str, i: int) -> Sample:
        a = rng.randint(self.cfg.min_operand, self.cfg.max_operand)
        b = rng.randint(self.cfg.min_operand, self.cfg.max_operand)
        op = rng.choice(self.cfg.ops)
        answer = str(_OPS[op](a, b))
        info = {"a": a, "b": b, "op": op, **self.interaction_for(i, answer=answer)}
        if self.cfg.prompt_format == "chat":
            question = CHAT_QUESTION.format(a=a, op=op, b=b)
            return Sample(id=idx, messages=[{"role": "user", "content": question}], answer=answer,
                          agent=self.agent_for(i), info=info)
        return Sample(id=idx, prompt=f"{a}{op}{b}=", answer=answer, agent=self.agent_for(i), info=info)

    def reward(self, sample: Sample, response_text: str) -> float:
        return exact_number_reward(response_text, sample.answer, self.cfg.answer_pick)
