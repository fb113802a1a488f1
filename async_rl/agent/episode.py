"""Token-exact bookkeeping of one multi-turn episode, and the agent loop's output.

An agent loop appends what the model sampled (`add_model_turn`, loss_mask 1, with the
log-prob and policy version of every token) and what the environment said — tool results,
user replies, template glue (`add_env_tokens`, loss_mask 0) — and never re-tokenises decoded
text: the ids the server sampled are the ids that are trained.

    ep = Episode(prompt_ids, max_response_tokens=256)
    out = await client.generate(ep.context_ids, params.with_budget(ep.remaining))
    ep.add_model_turn(out)
    ep.add_env_tokens(tool_ids, role="tool")
    return ep.output(reward=1.0, metrics={"tool_calls": 1})

`max_response_tokens` bounds everything after the prompt; tokens past it are cut together
with their mask, log-probs and versions, and `truncated` says so.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from async_rl.types import GenerationOutput, Trajectory, new_id


@dataclass(frozen=True, slots=True, kw_only=True)
class TurnSpan:
    """Where one turn's tokens lie in the response: [start, end)."""

    role: str  # assistant | tool | user | template
    start: int
    end: int
    score: float | None = None  # a turn-level reward (interaction turn score, tool reward)


@dataclass(frozen=True, slots=True, kw_only=True)
class AgentLoopOutput:
    """What an agent loop produces for one sample; `to_trajectory` makes it trainable."""

    prompt_ids: list[int]
    response_ids: list[int]
    response_mask: list[int]  # 1 = sampled by the model (trained), 0 = tool / user / template tokens
    behav_logprobs: list[float]  # 0.0 where response_mask is 0
    versions: list[int]  # policy version of each sampled token, -1 where response_mask is 0
    reward: float
    num_turns: int  # assistant turns
    finish_reason: str = "stop"
    num_interruptions: int = 0
    turns: tuple[TurnSpan, ...] = ()
    metrics: dict[str, float] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)

    def to_trajectory(self, group_id: str) -> Trajectory:
        info = dict(self.info)
        info["num_turns"] = self.num_turns
        info.update({f"agent/{k}": float(v) for k, v in self.metrics.items()})
        scored = [t for t in self.turns if t.score is not None]
        if scored:  # turn-level rewards, where advantage estimators can find them
            info["turn_scores"] = [float(t.score) for t in scored]
            info["turn_ends"] = [int(t.end) for t in scored]
        return Trajectory(
            id=new_id(), group_id=group_id,
            prompt_ids=np.asarray(self.prompt_ids, dtype=np.int32),
            response_ids=np.asarray(self.response_ids, dtype=np.int32),
            loss_mask=np.asarray(self.response_mask, dtype=np.uint8),
            behav_logprobs=np.asarray(self.behav_logprobs, dtype=np.float32),
            versions=np.asarray(self.versions, dtype=np.int32),
            reward=float(self.reward), finish_reason=self.finish_reason,
            num_interruptions=self.num_interruptions, timings=dict(self.timings), info=info)


class Episode:
    """The growing token record of one episode (see the module docstring)."""

    def __init__(self, prompt_ids: list[int], max_response_tokens: int):
        if max_response_tokens < 1:
            raise ValueError(f"max_response_tokens: must be >= 1, got {max_response_tokens}")
        self.prompt_ids = [int(t) for t in prompt_ids]
        self.max_response_tokens = max_response_tokens
        self.response_ids: list[int] = []
        self.mask: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []
        self.turns: list[TurnSpan] = []
        self.num_interruptions = 0
        self.truncated = False
        self.last_finish_reason = "stop"

    @property
    def context_ids(self) -> list[int]:
        """Prompt plus everything so far: the next generation request's prompt."""
        return self.prompt_ids + self.response_ids

    @property
    def remaining(self) -> int:
        """Response tokens still allowed."""
        return self.max_response_tokens - len(self.response_ids)

    @property
    def num_assistant_turns(self) -> int:
        return sum(1 for t in self.turns if t.role == "assistant")

    def _room(self, n: int) -> int:
        keep = min(n, max(self.remaining, 0))
        if keep < n:
            self.truncated = True
        return keep

    def add_model_turn(self, out: GenerationOutput, score: float | None = None) -> list[int]:
        """Append the tokens the server sampled (cut at the response limit); returns the kept ids."""
        keep = self._room(len(out.output_ids))
        start = len(self.response_ids)
        self.response_ids += out.output_ids[:keep]
        self.mask += [1] * keep
        self.logprobs += [float(x) for x in out.output_logprobs[:keep]]
        self.versions += [int(v) for v in out.output_versions[:keep]]
        self.turns.append(TurnSpan(role="assistant", start=start, end=start + keep, score=score))
        self.num_interruptions += out.num_interruptions
        self.last_finish_reason = "length" if keep < len(out.output_ids) else out.finish_reason
        return out.output_ids[:keep]

    def add_env_tokens(self, ids: list[int], role: str, score: float | None = None) -> int:
        """Append tokens the model did not sample (tool output, user reply, template glue); returns how many fit."""
        keep = self._room(len(ids))
        start = len(self.response_ids)
        self.response_ids += [int(t) for t in ids[:keep]]
        self.mask += [0] * keep
        self.logprobs += [0.0] * keep
        self.versions += [-1] * keep
        if keep:
            self.turns.append(TurnSpan(role=role, start=start, end=start + keep, score=score))
        return keep

    def score_last_assistant_turn(self, score: float) -> None:
        """Attach a turn-level score (e.g. an interaction's verdict) to the latest model turn."""
        for i in range(len(self.turns) - 1, -1, -1):
            if self.turns[i].role == "assistant":
                t = self.turns[i]
                self.turns[i] = TurnSpan(role=t.role, start=t.start, end=t.end, score=score)
                return

    def output(self, *, reward: float, finish_reason: str | None = None, metrics: dict[str, float] | None = None,
               timings: dict[str, float] | None = None, info: dict[str, Any] | None = None) -> AgentLoopOutput:
        reason = finish_reason or ("length" if self.truncated else self.last_finish_reason)
        return AgentLoopOutput(
            prompt_ids=list(self.prompt_ids), response_ids=list(self.response_ids), response_mask=list(self.mask),
            behav_logprobs=list(self.logprobs), versions=list(self.versions), reward=float(reward),
            num_turns=self.num_assistant_turns, finish_reason=reason, num_interruptions=self.num_interruptions,
            turns=tuple(self.turns), metrics=dict(metrics or {}), timings=dict(timings or {}), info=dict(info or {}))
