"""Test-only: imported into a run through `agent.modules` with `rollout.agent=nan_reward`, a single-turn agent
whose reward function returns NaN for about one sample (prompt) in seven, every answer of it: a reward
model that breaks on some problems. A run with it must finish its steps, say so, and account for every
sample in the audit (`tests/e2e/test_breakage.py`). Never part of a real run."""

import zlib

from async_rl.agent import register_agent_loop
from async_rl.agent.single_turn import SingleTurnAgentLoop

NAME = "nan_reward"


def broken_on_some(sample) -> bool:
    return zlib.crc32(sample.id.encode()) % 7 == 0


def flaky(reward_fn):
    def nan_on_some_samples(sample, text):
        score = reward_fn(sample, text)
        return float("nan") if broken_on_some(sample) else score
    nan_on_some_samples.__qualname__ = f"flaky({getattr(reward_fn, '__qualname__', reward_fn)})"
    return nan_on_some_samples


@register_agent_loop(NAME)
class NanRewardLoop(SingleTurnAgentLoop):
    def __init__(self, client, tokenizer, reward_fn, context=None):
        super().__init__(client, tokenizer, flaky(reward_fn), context)
