"""The agent-loop contract and its registry.

An agent loop turns one `Sample` into one `Trajectory` by talking to a generation
server: `async run(sample, sampling_params) -> Trajectory`. Loops are registered by
name and chosen per sample (`Sample.agent`), falling back to the configured default.
Trajectories are built from the exact token ids the server produced, never by
re-tokenising decoded text.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from typing import Any

from async_rl.protocols import GenerationClient
from async_rl.types import Sample, SamplingParams, Trajectory

RewardFn = Callable[[Sample, str], float]

AGENT_LOOPS: dict[str, type["AgentLoop"]] = {}


def register_agent_loop(name: str) -> Callable[[type["AgentLoop"]], type["AgentLoop"]]:
    def deco(cls: type[AgentLoop]) -> type[AgentLoop]:
        if name in AGENT_LOOPS and AGENT_LOOPS[name] is not cls:
            raise ValueError(f"agent loop {name!r} is already registered by {AGENT_LOOPS[name].__name__}")
        AGENT_LOOPS[name] = cls
        return cls
    return deco


class AgentLoop(abc.ABC):
    """One episode of interaction; subclasses implement `run`."""

    def __init__(self, client: GenerationClient, tokenizer: Any, reward_fn: RewardFn):
        self.client = client
        self.tokenizer = tokenizer
        self.reward_fn = reward_fn

    @abc.abstractmethod
    async def run(self, sample: Sample, sampling_params: SamplingParams, *, group_id: str) -> Trajectory:
        ...


def build_agent_loop(name: str, client: GenerationClient, tokenizer: Any, reward_fn: RewardFn) -> AgentLoop:
    if name not in AGENT_LOOPS:
        raise ValueError(f"agent: unknown agent loop {name!r}; registered: {', '.join(sorted(AGENT_LOOPS))}")
    return AGENT_LOOPS[name](client, tokenizer, reward_fn)
