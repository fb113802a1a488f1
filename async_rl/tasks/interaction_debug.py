"""A simulated-user task the tiny model can learn: the user says a digit, the model repeats it.

The user opens with "say 3"; the model's turn must be exactly "3". A wrong turn gets
"no, say 3" from the user (the `echo_user` interaction of configs/interactions/default.yaml)
and another try, up to the interaction's `max_turns`; the episode's reward is the
interaction's score (1, halved for every wrong try, 0 if never right). Digits are drawn
from [task.min_operand, task.max_operand]. The held-out digits (a third of them, at most
`task.eval_size`: one of configs/interaction_debug.yaml's five) are never said in training, so
their accuracy measures whether the model copies a digit it was never rewarded for.

Samples name the agent loop (`tool_agent`, or `task.agents` cycled per prompt) and the
interaction (`echo_user`, or `task.interactions` cycled per prompt) with
`info={"interaction": name, "interaction_kwargs": {"text": "3", "answer": "3"}}` ("answer"
lets `arith_user` judge the same samples). Every character the user says, and the ChatML
role names around it, must be in the tiny model's alphabet: configs/interaction_debug.yaml
sets one that covers `USER_CHARS`.
"""

from __future__ import annotations

import random

from async_rl.config import TaskConfig
from async_rl.tasks.generated import GeneratedTask
from async_rl.types import Sample

OPENING = "say {text}"
# what the user and the chat template say around the model's turns (see configs/interactions/default.yaml)
USER_CHARS = set("say no,") | set("user assistant\n")  # plus the digits drawn


class InteractionDebugTask(GeneratedTask):
    """"say 3" -> "3"; the episode's reward is the interaction's score (`reward` judges one reply: the
    stripped reply equals the digit)."""

    default_agent = "tool_agent"
    default_interaction = "echo_user"

    def __init__(self, cfg: TaskConfig):
        if cfg.min_operand < 0 or cfg.max_operand > 9:
            raise ValueError(f"task.min_operand/max_operand: interaction_debug draws single digits, so both must "
                             f"lie in 0..9, got {cfg.min_operand}..{cfg.max_operand}")
        super().__init__(cfg)

    def problem_count(self) -> int:
        return max(0, self.cfg.max_operand - self.cfg.min_operand + 1)

    def _make(self, rng: random.Random, idx: str, i: int) -> Sample:
        text = str(rng.randint(self.cfg.min_operand, self.cfg.max_operand))
        return Sample(id=idx, messages=[{"role": "user", "content": OPENING.format(text=text)}], answer=text,
                      agent=self.agent_for(i), info=self.interaction_for(i, text=text, answer=text))

    def reward(self, sample: Sample, response_text: str) -> float:
        return 1.0 if response_text.strip() == sample.answer else 0.0
