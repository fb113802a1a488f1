"""Built-in simulated users: `arith_user` (checks an arithmetic answer, asks again) and `echo_user`.

Both judge the model's latest turn against what the sample's `interaction_kwargs` say is
right, reply when it is wrong, and keep per-episode state in a dict keyed by the instance
id (made in `start_interaction`, dropped in `finalize_interaction`). The episode's score is
1 when the model got it right at its first answer, discounted by `discount` for every wrong
answer before that; when it never got it right:

    score = discount ** wrong_answers   if solved
            format_score                if it answered but never right (default 0)
            0                           if it never answered

An answer is a turn the user judged that holds one (arith_user: a number; echo_user: any
text). A turn the agent loop cuts at its token limit never reaches the user, and an empty
turn says nothing, so a small `format_score` makes a wrong answer better than either;
without it a policy can escape judgement by never ending its turns (the interaction_debug
config sets 0.1).

Turn scores (1 for the answer that was right, 0 for a wrong one) go with every reply, so a
turn-level advantage estimator (`trainer.advantage: grpo_turn`) can credit single turns.

    interactions:
      - name: arith_user
        config: {max_turns: 3, feedback: hint, discount: 0.5}
      - name: echo_user
        config: {max_turns: 3, match: exact, format_score: 0.1}
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from async_rl.agent.interactions.base import BaseInteraction, InteractionTurn, register_interaction
from async_rl.rewards.math import last_number

logger = logging.getLogger(__name__)


def last_assistant_text(messages: list[dict[str, Any]]) -> str:
    """Content of the latest assistant message ("" when there is none)."""
    for msg in reversed(messages):
        if msg.get("role") == "assistant":
            content = msg.get("content")
            return content if isinstance(content, str) else ""
    return ""


class _JudgingUser(BaseInteraction):
    """Shared bookkeeping: per-instance state, a turn budget, and the discounted episode score."""

    def __init__(self, name: str = "", *, max_turns: int = 3, discount: float = 0.5, format_score: float = 0.0,
                 **config: Any):
        super().__init__(name, max_turns=max_turns, discount=discount, format_score=format_score, **config)
        label = name or type(self).__name__
        if not isinstance(max_turns, int) or max_turns < 1:
            raise ValueError(f"interaction {label}: config.max_turns must be an integer >= 1, got {max_turns!r}")
        if not isinstance(discount, (int, float)) or not 0.0 <= discount <= 1.0:
            raise ValueError(f"interaction {label}: config.discount must be in [0, 1], got {discount!r}")
        if not isinstance(format_score, (int, float)) or not 0.0 <= format_score <= 1.0:
            raise ValueError(f"interaction {label}: config.format_score must be in [0, 1], got {format_score!r}")
        self.max_turns = max_turns
        self.discount = float(discount)
        self.format_score = float(format_score)
        self._state: dict[str, dict[str, Any]] = {}

    def _get(self, instance_id: str) -> dict[str, Any]:
        try:
            return self._state[instance_id]
        except KeyError:
            raise ValueError(f"interaction {self.name or type(self).__name__}: unknown instance {instance_id!r} "
                             "(start_interaction was not called, or it was already finalized)") from None

    def _start(self, instance_id: str, target: str) -> str:
        self._state[instance_id] = {"target": target, "wrong": 0, "turns": 0, "answered": 0, "solved": False}
        return instance_id

    def _judge(self, instance_id: str, correct: bool, answered: bool, wrong_reply: str) -> InteractionTurn:
        """Record a verdict; `answered`: the turn was an answer at all (for `format_score`)."""
        st = self._get(instance_id)
        st["turns"] += 1
        st["answered"] += int(answered or correct)
        if correct:
            st["solved"] = True
            return InteractionTurn(done=True, reply="", score=1.0, extra={"turn": st["turns"], "correct": True})
        st["wrong"] += 1
        done = st["turns"] >= self.max_turns
        return InteractionTurn(done=done, reply="" if done else wrong_reply, score=0.0,
                               extra={"turn": st["turns"], "correct": False})

    async def calculate_score(self, instance_id: str) -> float:
        st = self._get(instance_id)
        if st["solved"]:
            return self.discount ** st["wrong"]
        return self.format_score if st["answered"] else 0.0

    async def finalize_interaction(self, instance_id: str) -> None:
        self._state.pop(instance_id, None)

    def _target(self, kwargs: dict[str, Any], key: str) -> str:
        if key not in kwargs or kwargs[key] is None or str(kwargs[key]) == "":
            raise ValueError(f"interaction {self.name or type(self).__name__}: interaction_kwargs needs "
                             f"{key!r} (got keys {sorted(kwargs)})")
        return str(kwargs[key])


# What arith_user says after a wrong answer: feedback name -> (got number or None, answer) -> reply.
def _retry(got: str | None, answer: str) -> str:
    return "No, try again."


def _hint(got: str | None, answer: str) -> str:
    if got is None:
        return "I see no number. Answer with just the number."
    try:
        return "No, that is too high." if float(got) > float(answer) else "No, that is too low."
    except ValueError:
        return "No, try again."


FEEDBACK: dict[str, Callable[[str | None, str], str]] = {"retry": _retry, "hint": _hint}


@register_interaction("arith_user")
class ArithUser(_JudgingUser):
    """A user who asked an arithmetic question: the last number of the model's turn must equal
    `interaction_kwargs["answer"]`; a wrong answer gets `feedback` (retry | hint) until `max_turns`."""

    def __init__(self, name: str = "", *, feedback: str = "retry", max_turns: int = 3, discount: float = 0.5,
                 format_score: float = 0.0):
        super().__init__(name, max_turns=max_turns, discount=discount, format_score=format_score, feedback=feedback)
        if feedback not in FEEDBACK:
            raise ValueError(f"interaction {name or 'arith_user'}: config.feedback must be one of "
                             f"{'|'.join(FEEDBACK)}, got {feedback!r}")
        self.feedback = FEEDBACK[feedback]

    async def start_interaction(self, instance_id: str, **kwargs: Any) -> str:
        answer = self._target(kwargs, "answer")
        try:
            float(answer)
        except ValueError:
            raise ValueError(f"interaction {self.name or 'arith_user'}: interaction_kwargs.answer must be a "
                             f"number, got {answer!r}") from None
        return self._start(instance_id, answer)

    async def generate_response(self, instance_id: str, messages: list[dict[str, Any]],
                                **kwargs: Any) -> InteractionTurn:
        answer = self._get(instance_id)["target"]
        got = last_number(last_assistant_text(messages))
        correct = got is not None and float(got) == float(answer)
        return self._judge(instance_id, correct, got is not None, self.feedback(got, answer))


# How echo_user compares the model's turn (stripped) with the text it asked for.
MATCHES: dict[str, Callable[[str, str], bool]] = {
    "exact": lambda said, text: said == text,
    "prefix": lambda said, text: said.startswith(text),  # the turn begins with the text
}


@register_interaction("echo_user")
class EchoUser(_JudgingUser):
    """A user who says something and wants it repeated: the model's turn (stripped) must equal
    (`match: exact`) or begin with (`match: prefix`) `interaction_kwargs["text"]`; a wrong turn gets
    `retry` ({text} filled in)."""

    def __init__(self, name: str = "", *, retry: str = "no, say {text}", match: str = "exact", max_turns: int = 3,
                 discount: float = 0.5, format_score: float = 0.0):
        super().__init__(name, max_turns=max_turns, discount=discount, format_score=format_score, retry=retry,
                         match=match)
        label = name or "echo_user"
        try:
            retry.format(text="0")
        except (AttributeError, KeyError, IndexError, ValueError):
            raise ValueError(f"interaction {label}: config.retry must be a string whose only field is {{text}}, "
                             f"got {retry!r}") from None
        if match not in MATCHES:
            raise ValueError(f"interaction {label}: config.match must be one of {'|'.join(MATCHES)}, got {match!r}")
        self.retry = retry
        self.match = MATCHES[match]

    async def start_interaction(self, instance_id: str, **kwargs: Any) -> str:
        return self._start(instance_id, self._target(kwargs, "text"))

    async def generate_response(self, instance_id: str, messages: list[dict[str, Any]],
                                **kwargs: Any) -> InteractionTurn:
        text = self._get(instance_id)["target"]
        said = last_assistant_text(messages).strip()
        return self._judge(instance_id, self.match(said, text), bool(said), self.retry.format(text=text))
