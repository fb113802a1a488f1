"""The agent-loop contract and its registry.

An agent loop turns one `Sample` into one trajectory by talking to a generation
server: `async run(sample, sampling_params, group_id=...) -> AgentLoopOutput | Trajectory`
(an `AgentLoopOutput`, built with `Episode`, becomes a `Trajectory` through
`as_trajectory`). Loops are registered by name and chosen per sample (`Sample.agent`),
falling back to the configured default; `agent.modules` names modules to import first,
so a user's agent in its own file registers itself. Trajectories are built from the
exact token ids the server produced, never by re-tokenising decoded text.

What every loop of a run shares — the configured tools, interactions, tool-call parser,
agent limits and the trace writer — comes in one `AgentContext`, built once per run by
`build_agent_context`.
"""

from __future__ import annotations

import abc
import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from async_rl.agent.episode import AgentLoopOutput
from async_rl.agent.interactions.base import BaseInteraction, load_interactions
from async_rl.agent.tools.base import BaseTool, load_tools
from async_rl.protocols import GenerationClient
from async_rl.tool_parsers import ToolParser, build_tool_parser
from async_rl.types import Sample, SamplingParams, Trajectory
from async_rl.utils.registry import registrar

RewardFn = Callable[[Sample, str], float]

AGENT_LOOPS: dict[str, type["AgentLoop"]] = {}


register_agent_loop = registrar(AGENT_LOOPS, "agent loop")  # @register_agent_loop("name") on an AgentLoop


@dataclass
class AgentContext:
    """What the agent loops of one run share (built once by `build_agent_context`)."""

    config: Any = None  # the `agent` config section (AgentConfig); None = defaults of the loop
    tools: dict[str, BaseTool] = field(default_factory=dict)
    interactions: dict[str, BaseInteraction] = field(default_factory=dict)
    tool_parser: ToolParser | None = None
    trace: Callable[[dict[str, Any]], None] | None = None  # writes one episode's trace (None = tracing off)


def import_agent_modules(modules: list[str]) -> None:
    """Import user modules so their `@register_agent_loop` / tools / interactions register."""
    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError as exc:
            raise ValueError(f"agent.modules: cannot import {name!r} ({exc})") from None


def build_agent_context(agent_cfg: Any, trace: Callable[[dict[str, Any]], None] | None = None,
                        prepare: bool = True) -> AgentContext:
    """Tools, interactions and parser of the `agent` config section (errors name the key). With
    `prepare`, each tool also checks this machine for what its episodes need (`BaseTool.prepare`)."""
    import_agent_modules(list(agent_cfg.modules))
    tools = load_tools(agent_cfg.tools_config) if agent_cfg.tools_config else {}
    if prepare:
        for name, tool in tools.items():
            try:
                tool.prepare()
            except ValueError as exc:
                raise ValueError(f"agent.tools_config={agent_cfg.tools_config}: tool {name!r}: {exc}") from None
    interactions = load_interactions(agent_cfg.interactions_config) if agent_cfg.interactions_config else {}
    return AgentContext(config=agent_cfg, tools=tools, interactions=interactions,
                        tool_parser=build_tool_parser(agent_cfg.tool_parser), trace=trace)


def check_agent_names(context: AgentContext, default_agent: str, used: dict[str, dict[str, list[str]]]) -> None:
    """Every agent loop and interaction a run's samples can name exists: `default_agent` is
    `rollout.agent`, `used` the task's `names_used()`. The error names what chose the name."""
    for source, names in {"rollout.agent": [default_agent], **used.get("agents", {})}.items():
        unknown = [n for n in names if n not in AGENT_LOOPS]
        if unknown:
            raise ValueError(f"{source}: unknown agent loop {', '.join(map(repr, unknown))}; registered: "
                             f"{', '.join(sorted(AGENT_LOOPS))} (a loop of your own registers itself when "
                             "agent.modules imports its module)")
    for source, names in used.get("interactions", {}).items():
        unknown = [n for n in names if n not in context.interactions]
        if unknown:
            path = getattr(context.config, "interactions_config", "")
            raise ValueError(f"{source}: unknown interaction {', '.join(map(repr, unknown))}; configured: "
                             f"{', '.join(sorted(context.interactions)) or 'none'} "
                             f"(agent.interactions_config{'=' + path if path else ' is unset'})")


class AgentLoop(abc.ABC):
    """One episode of interaction; subclasses implement `run`."""

    def __init__(self, client: GenerationClient, tokenizer: Any, reward_fn: RewardFn,
                 context: AgentContext | None = None):
        self.client = client
        self.tokenizer = tokenizer
        self.reward_fn = reward_fn
        self.context = context or AgentContext()

    @abc.abstractmethod
    async def run(self, sample: Sample, sampling_params: SamplingParams, *,
                  group_id: str) -> AgentLoopOutput | Trajectory:
        ...


def as_trajectory(result: AgentLoopOutput | Trajectory, group_id: str, sample: Sample) -> Trajectory:
    """What a loop returned, as a trainable `Trajectory` carrying its sample id."""
    if isinstance(result, AgentLoopOutput):
        result = result.to_trajectory(group_id)
    if not isinstance(result, Trajectory):
        raise TypeError(f"agent loop for sample {sample.id} returned {type(result).__name__}, "
                        "expected AgentLoopOutput or Trajectory")
    if "sample_id" not in result.info:
        result.info["sample_id"] = sample.id
    return result


def build_agent_loop(name: str, client: GenerationClient, tokenizer: Any, reward_fn: RewardFn,
                     context: AgentContext | None = None) -> AgentLoop:
    if name not in AGENT_LOOPS:
        raise ValueError(f"agent: unknown agent loop {name!r}; registered: {', '.join(sorted(AGENT_LOOPS))}")
    return AGENT_LOOPS[name](client, tokenizer, reward_fn, context)
