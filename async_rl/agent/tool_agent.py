"""The tool-calling agent loop: a small state machine over one multi-turn episode.

    PENDING ──► GENERATING ──► PROCESSING_TOOLS ──► GENERATING ...
                    │      └─► INTERACTING ──────► GENERATING ...
                    └────────────────┴────────────► TERMINATED

- PENDING: the prompt is `sample.messages` (or `sample.prompt` as one user message) through the
  chat template with the schemas of this sample's tools (`sample.info["tools"]`: names; default
  every configured tool) passed as `tools=`. A template that ignores `tools` (SmolLM2's does)
  still works, but the model then only knows the tools the task's system prompt describes.
  Each tool gets a per-episode instance (`create`, kwargs from `sample.info["tools_kwargs"][name]`);
  the interaction named by `sample.info["interaction"]` is started (`interaction_kwargs`).
- GENERATING: one `generate` call on the exact token context, at most `episode.remaining` new
  tokens, sampled per `sampling_params_for_turn`; the kept ids are decoded and parsed for tool
  calls. A turn cut by the response limit (or `max_new_tokens`) or aborted -> TERMINATED; no
  calls and an interaction -> INTERACTING (which scores the turn even at the turn limit);
  `max_assistant_turns` reached, or no calls -> TERMINATED; calls -> PROCESSING_TOOLS.
- PROCESSING_TOOLS: the turn's calls run concurrently (`tool_calls.run_tool_calls`; errors become
  tool messages); the tool messages become tokens with mask 0 (`chat_tokens`) -> GENERATING.
- INTERACTING: the interaction answers; its score goes to the model's last turn; done,
  `max_user_turns` replies already given, or `max_assistant_turns` reached -> TERMINATED, else
  its reply becomes a user turn (mask 0) -> GENERATING.
- TERMINATED: the reward, then tool instances are released and the interaction finalised
  (always, in a `finally`).

Reward: with an interaction, `calculate_score` (turn scores stay on their turns, in
`info["turn_scores"]`); without one, `reward_fn(sample, final_text)` where final_text is the
last assistant turn decoded without special tokens. Tool rewards are added to either: every
call's `ToolResult.reward` and every instance's `calc_reward` (0 for tools that do not score; a
scoring tool should use one of the two, not both). Per-sample metrics (tool calls, errors,
turns, reward parts) reach the trajectory as `info["agent/<name>"]`.

A tool call the model gets wrong never ends the episode (the model reads an error, see
`tool_calls`); a tool's `create` or an interaction that raises does (after clean-up): those
are bugs of the environment, not mistakes of the policy.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from async_rl.agent.base import AGENT_LOOPS, AgentLoop, register_agent_loop
from async_rl.agent.chat_tokens import env_ids_after_turn, stop_token_of_turn
from async_rl.agent.episode import AgentLoopOutput, Episode
from async_rl.agent.interactions.base import BaseInteraction
from async_rl.agent.tool_calls import CallOutcome, run_tool_calls
from async_rl.agent.tools.base import BaseTool
from async_rl.config import AgentConfig
from async_rl.models import chat_prompt_ids
from async_rl.tool_parsers import ToolCall, build_tool_parser
from async_rl.types import Sample, SamplingParams, new_id

logger = logging.getLogger(__name__)


class State(enum.Enum):
    PENDING = "pending"
    GENERATING = "generating"
    PROCESSING_TOOLS = "processing_tools"
    INTERACTING = "interacting"
    TERMINATED = "terminated"


@dataclass
class EpisodeRun:
    """Everything one episode of the loop carries from state to state."""

    sample: Sample
    params: SamplingParams
    episode: Episode | None = None
    messages: list[dict[str, Any]] = field(default_factory=list)  # the conversation as the template sees it
    tools: dict[str, BaseTool] = field(default_factory=dict)  # the tools this sample may call
    schemas: list[dict[str, Any]] | None = None
    instances: dict[str, str] = field(default_factory=dict)  # tool name -> instance id (created ones only)
    interaction: BaseInteraction | None = None
    interaction_id: str | None = None
    pending_calls: list[ToolCall] = field(default_factory=list)
    sampled_tail: str = ""  # text of the stop token that ended the last model turn ("" if none)
    final_text: str = ""
    user_turns: int = 0
    call_rewards: float = 0.0
    terminated_by: str = ""
    finish_reason: str | None = None  # overrides the episode's own when set
    metrics: dict[str, float] = field(default_factory=lambda: {"tool_calls": 0.0, "tool_errors": 0.0})
    timings: dict[str, float] = field(default_factory=lambda: {"generate_s": 0.0, "tool_s": 0.0,
                                                               "interaction_s": 0.0})
    trace_turns: list[dict[str, Any]] = field(default_factory=list)

    def stop(self, why: str, finish_reason: str | None = None) -> State:
        self.terminated_by = why
        self.finish_reason = finish_reason or self.finish_reason
        return State.TERMINATED


@register_agent_loop("tool_agent")
class ToolAgentLoop(AgentLoop):
    """Multi-turn episodes with tool calls and an optional interaction (see the module docstring)."""

    def sampling_params_for_turn(self, params: SamplingParams, turn_index: int) -> SamplingParams:
        """How assistant turn `turn_index` (0-based) is sampled; subclasses may vary it per turn."""
        return params

    @property
    def limits(self) -> AgentConfig:
        return self.context.config or AgentConfig()

    @property
    def name(self) -> str:
        return next((k for k, v in AGENT_LOOPS.items() if v is type(self)), type(self).__name__)

    async def run(self, sample: Sample, sampling_params: SamplingParams, *, group_id: str) -> AgentLoopOutput:
        run = EpisodeRun(sample=sample, params=sampling_params)
        steps = {State.PENDING: self._pending, State.GENERATING: self._generate,
                 State.PROCESSING_TOOLS: self._process_tools, State.INTERACTING: self._interact}
        t0 = time.perf_counter()
        state = State.PENDING
        try:
            while state is not State.TERMINATED:
                state = await steps[state](run)
            reward = await self._reward(run)
        finally:
            await self._release(run)
        run.timings["total_s"] = time.perf_counter() - t0
        run.metrics.update(turns=float(run.episode.num_assistant_turns), user_turns=float(run.user_turns))
        out = run.episode.output(reward=reward, finish_reason=run.finish_reason, metrics=run.metrics,
                                 timings=run.timings, info={"sample_id": sample.id, "agent": self.name,
                                                            "terminated_by": run.terminated_by})
        if self.context.trace is not None:
            self.context.trace(self._trace_record(run, out, group_id))
        return out

    # ------------------------------------------------------------------ states
    async def _pending(self, run: EpisodeRun) -> State:
        sample = run.sample
        run.tools = self._tools_for(sample)
        run.schemas = [t.schema for t in run.tools.values()] or None
        if sample.messages is not None:
            run.messages = [dict(m) for m in sample.messages]
        elif sample.prompt is not None:
            run.messages = [{"role": "user", "content": sample.prompt}]
        else:
            raise ValueError(f"sample {sample.id}: has neither messages nor prompt")
        run.episode = Episode(chat_prompt_ids(self.tokenizer, run.messages, tools=run.schemas),
                              max_response_tokens=self.limits.max_response_tokens)
        run.interaction = self._interaction_for(sample)
        tools_kwargs = sample.info.get("tools_kwargs") or {}
        for name, tool in run.tools.items():
            run.instances[name] = await tool.create(new_id(), **(tools_kwargs.get(name) or {}))
        if run.interaction is not None:
            run.interaction_id = await run.interaction.start_interaction(
                new_id(), **(sample.info.get("interaction_kwargs") or {}))
        return State.GENERATING

    async def _generate(self, run: EpisodeRun) -> State:
        ep = run.episode
        if ep.remaining <= 0:
            return run.stop("max_response_tokens", "length")
        params = self.sampling_params_for_turn(run.params, ep.num_assistant_turns)
        params = dataclasses.replace(params, max_new_tokens=min(params.max_new_tokens, ep.remaining))
        t0 = time.perf_counter()
        out = await self.client.generate(ep.context_ids, params)
        gen_s = time.perf_counter() - t0
        run.timings["generate_s"] += gen_s
        start = len(ep.response_ids)
        kept = ep.add_model_turn(out)
        finish = out.finish_reason if len(kept) == len(out.output_ids) else "length"
        calls = self._read_turn(run, kept, out.output_versions[:len(kept)], finish, params, start, gen_s)
        if out.finish_reason == "abort":
            return run.stop("abort", "abort")
        if finish == "length":
            return run.stop("max_response_tokens" if ep.truncated or ep.remaining <= 0 else "max_new_tokens")
        if run.interaction is not None and not calls:
            return State.INTERACTING  # it scores this turn even when no further turn is allowed
        if ep.num_assistant_turns >= self.limits.max_assistant_turns:
            return run.stop("max_assistant_turns")
        if calls:
            run.pending_calls = calls
            return State.PROCESSING_TOOLS
        return run.stop("answered")

    async def _process_tools(self, run: EpisodeRun) -> State:
        calls, run.pending_calls = run.pending_calls, []
        t0 = time.perf_counter()
        outcomes = await run_tool_calls(calls, run.tools, run.instances, self.limits.max_parallel_tool_calls)
        tool_s = time.perf_counter() - t0
        run.timings["tool_s"] += tool_s
        self._count(run, outcomes)
        span = self._append_env(run, [{"role": "tool", "content": o.text, "name": o.name} for o in outcomes], "tool")
        run.trace_turns.append({
            "role": "tool", "mask": list(span), "timings": {"tool_s": round(tool_s, 4)},
            "outputs": [{"name": o.name, "text": o.text, "error": o.error, "seconds": round(o.seconds, 4)}
                        for o in outcomes]})
        return self._after_env(run)

    async def _interact(self, run: EpisodeRun) -> State:
        t0 = time.perf_counter()
        turn = await run.interaction.generate_response(run.interaction_id, [dict(m) for m in run.messages])
        run.timings["interaction_s"] += time.perf_counter() - t0
        run.episode.score_last_assistant_turn(float(turn.score))
        run.trace_turns[-1]["score"] = float(turn.score)
        if turn.done:
            return run.stop("interaction_done")
        if run.user_turns >= self.limits.max_user_turns:
            return run.stop("max_user_turns")
        if run.episode.num_assistant_turns >= self.limits.max_assistant_turns:
            return run.stop("max_assistant_turns")
        span = self._append_env(run, [{"role": "user", "content": turn.reply}], "user")
        run.user_turns += 1
        run.trace_turns.append({"role": "user", "text": turn.reply, "mask": list(span),
                                "timings": {"interaction_s": round(time.perf_counter() - t0, 4)}})
        return self._after_env(run)

    # ------------------------------------------------------------------ helpers
    def _read_turn(self, run: EpisodeRun, kept: list[int], versions: list[int], finish: str,
                   params: SamplingParams, start: int, gen_s: float) -> list[ToolCall]:
        """Decode a model turn into the conversation and the trace; returns its tool calls."""
        stop_id = stop_token_of_turn(self.tokenizer, kept, finish, params.stop_token_ids)
        text = self.tokenizer.decode(kept if stop_id is None else kept[:-1], skip_special_tokens=False)
        run.sampled_tail = "" if stop_id is None else self.tokenizer.decode([stop_id], skip_special_tokens=False)
        run.final_text = self.tokenizer.decode(kept, skip_special_tokens=True)
        run.messages.append({"role": "assistant", "content": text})
        _, calls = (self.context.tool_parser or build_tool_parser(self.limits.tool_parser)).parse(text)
        run.trace_turns.append({
            "role": "assistant", "text": self.tokenizer.decode(kept, skip_special_tokens=False),
            "tool_calls": [{"name": c.name, "arguments": c.arguments, **({"error": c.error} if c.error else {})}
                           for c in calls],
            "mask": [start, start + len(kept)], "versions": [min(versions), max(versions)] if versions else [],
            "score": None, "finish_reason": finish, "timings": {"generate_s": round(gen_s, 4)}})
        return calls

    def _append_env(self, run: EpisodeRun, new_messages: list[dict[str, Any]], role: str) -> tuple[int, int]:
        """Tokens of `new_messages` (plus template glue and the next generation prompt), mask 0."""
        ids = env_ids_after_turn(self.tokenizer, run.messages, new_messages, tools=run.schemas,
                                 sampled_tail=run.sampled_tail)
        start = len(run.episode.response_ids)
        kept = run.episode.add_env_tokens(ids, role)
        run.messages.extend(new_messages)
        return start, start + kept

    @staticmethod
    def _after_env(run: EpisodeRun) -> State:
        if run.episode.truncated or run.episode.remaining <= 0:
            return run.stop("max_response_tokens", "length")
        return State.GENERATING

    @staticmethod
    def _count(run: EpisodeRun, outcomes: list[CallOutcome]) -> None:
        run.metrics["tool_calls"] += len(outcomes)
        run.metrics["tool_errors"] += sum(o.error for o in outcomes)
        run.call_rewards += sum(o.reward or 0.0 for o in outcomes)
        for o in outcomes:
            for key, value in o.metrics.items():
                run.metrics[key] = run.metrics.get(key, 0.0) + float(value)

    def _tools_for(self, sample: Sample) -> dict[str, BaseTool]:
        names = sample.info.get("tools")
        if names is None:
            return dict(self.context.tools)
        unknown = [n for n in names if n not in self.context.tools]
        if unknown:
            raise ValueError(f"sample {sample.id}: info.tools names unknown tool(s) {unknown}; configured: "
                             f"{', '.join(sorted(self.context.tools)) or 'none'} (agent.tools_config)")
        return {n: self.context.tools[n] for n in names}

    def _interaction_for(self, sample: Sample) -> BaseInteraction | None:
        name = sample.info.get("interaction")
        if not name:
            return None
        if name not in self.context.interactions:
            raise ValueError(f"sample {sample.id}: unknown interaction {name!r}; configured: "
                             f"{', '.join(sorted(self.context.interactions)) or 'none'} (agent.interactions_config)")
        return self.context.interactions[name]

    async def _reward(self, run: EpisodeRun) -> float:
        tool_reward = run.call_rewards
        for name, iid in run.instances.items():
            try:
                tool_reward += float(await run.tools[name].calc_reward(iid))
            except Exception as exc:
                logger.warning("tool %r calc_reward raised %s: %s; counted as 0", name, type(exc).__name__, exc)
        if run.interaction is not None:
            base = float(await run.interaction.calculate_score(run.interaction_id))
            run.metrics["interaction_score"] = base
        else:
            base = float(self.reward_fn(run.sample, run.final_text))
            run.metrics["task_reward"] = base
        run.metrics["tool_reward"] = tool_reward
        return base + tool_reward

    async def _release(self, run: EpisodeRun) -> None:
        for name, iid in run.instances.items():
            try:
                await run.tools[name].release(iid)
            except Exception as exc:
                logger.warning("tool %r release raised %s: %s", name, type(exc).__name__, exc)
        if run.interaction is not None and run.interaction_id is not None:
            try:
                await run.interaction.finalize_interaction(run.interaction_id)
            except Exception as exc:
                logger.warning("interaction %r finalize raised %s: %s", run.interaction.name, type(exc).__name__, exc)

    def _trace_record(self, run: EpisodeRun, out: AgentLoopOutput, group_id: str) -> dict[str, Any]:
        return {"sample_id": run.sample.id, "agent": self.name, "group_id": group_id, "reward": out.reward,
                "finish_reason": out.finish_reason, "terminated_by": run.terminated_by,
                "prompt_tokens": len(out.prompt_ids), "response_tokens": len(out.response_ids),
                "sampled_tokens": int(sum(out.response_mask)), "turns": run.trace_turns,
                "metrics": dict(out.metrics), "timings": {k: round(v, 4) for k, v in out.timings.items()}}
