"""Tool-integrated reasoning on arithmetic: multi-digit problems where calling a tool pays.

Each sample is a chat whose system prompt says a `python` tool and a `calculator` are
available and shows how to call one in the Hermes format the tool agent loop parses:

    <tool_call>{"name": "python", "arguments": {"code": "print(17*23)"}}</tool_call>

followed by one worked example (question, that call, its result, the answer), then the question.

The tool schemas also go to the chat template (`tools=`), but small models' templates
often ignore them, so the system prompt carries everything the model needs. Samples run
on `tool_agent` (or the loops `task.agents` names, cycled per prompt); the reward is 1 when
the last number of the final assistant turn equals the answer (`task.answer_pick`).

The held-out set is `task.eval_size` distinct problems (at most a third of the space) that the
training stream never shows. The evaluation runs each of them as a greedy episode of its own
agent loop with the run's tools, as in training: a first turn that calls a tool and a second
that answers from its result scores 1.
"""

from __future__ import annotations

import operator
import random

from async_rl.config import TaskConfig
from async_rl.rewards.math import exact_number_reward
from async_rl.tasks.arith import operand_problems
from async_rl.tasks.generated import GeneratedTask
from async_rl.types import Sample

_OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul}
SYSTEM_PROMPT = (
    "You are a careful assistant who solves arithmetic with tools. Tools you can call:\n"
    "- python: runs Python code and returns what it prints. Arguments: {\"code\": \"...\"}\n"
    "- calculator: evaluates an arithmetic expression. Arguments: {\"expression\": \"...\"}\n"
    "To call a tool, write exactly one line like\n"
    "<tool_call>{\"name\": \"python\", \"arguments\": {\"code\": \"print(17*23)\"}}</tool_call>\n"
    "and stop; the result comes back in the next message. Then give the final answer as "
    "\"The answer is N.\""
)
QUESTION = "What is {a} {op} {b}?"
# One worked example before the question: small models copy a format from the conversation far more
# readily than from instructions (SmolLM2-135M calls a tool in about 0.4 of first turns with it, never
# without it).
EXAMPLE = [
    {"role": "user", "content": QUESTION.format(a=17, op="*", b=23)},
    {"role": "assistant", "content": '<tool_call>{"name": "python", "arguments": {"code": "print(17*23)"}}</tool_call>'},
    {"role": "tool", "content": "391"},
    {"role": "assistant", "content": "The answer is 391."},
]


class TirArithTask(GeneratedTask):
    """"What is 347 * 86?" with tools on offer; reward = exact last number of the final answer."""

    default_agent = "tool_agent"

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
        messages = [{"role": "system", "content": SYSTEM_PROMPT}, *[dict(m) for m in EXAMPLE],
                    {"role": "user", "content": QUESTION.format(a=a, op=op, b=b)}]
        return Sample(id=idx, messages=messages, answer=answer, agent=self.agent_for(i),
                      info={"a": a, "b": b, "op": op, **self.interaction_for(i, answer=answer)})

    def reward(self, sample: Sample, response_text: str) -> float:
        return exact_number_reward(response_text, sample.answer, self.cfg.answer_pick)
