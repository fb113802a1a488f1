"""Arithmetic problems with an exact-answer reward.

Operands are drawn uniformly from [min_operand, max_operand]. The held-out set is
`task.eval_size` distinct problems drawn with `task.eval_seed` (at most a third of the
problem space); the training stream, seeded by the run's seed, never shows one of them.
The demo (operands 0..19, 400 sums) holds out 64 sums and trains on the other 336; the
debug config (operands 0..2, 9 sums) holds out 3 and trains on 6, so its accuracy says
whether the tiny model generalises to sums it never saw, not whether it learned its own.
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


def operand_problems(cfg: TaskConfig) -> int:
    """Distinct problems "a op b" with both operands in [min_operand, max_operand]."""
    return max(0, cfg.max_operand - cfg.min_operand + 1) ** 2 * len(set(cfg.ops))


class ArithTask(GeneratedTask):
    """Problems like "23+45=" (raw) or "What is 23 + 45? ..." (chat), reward = exact answer. Samples
    run on `rollout.agent` unless `task.agents` names loops; `task.interactions` adds a simulated
    user that judges the answer (`interaction_kwargs.answer`)."""

    def __init__(self, cfg: TaskConfig):
        unknown = [op for op in cfg.ops if op not in _OPS]
        if unknown or not cfg.ops:
            raise ValueError(f"task.ops: unknown operator(s) {unknown or cfg.ops}; allowed: {sorted(_OPS)}")
        super().__init__(cfg)

    def problem_count(self) -> int:
        return operand_problems(self.cfg)

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
