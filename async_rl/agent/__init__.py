"""Agent loops: per-sample episodes that produce trajectories (single-turn built in)."""

from async_rl.agent import single_turn  # noqa: F401  (registers "single_turn")
from async_rl.agent import tool_agent  # noqa: F401  (registers "tool_agent")
from async_rl.agent.base import (AGENT_LOOPS, AgentContext, AgentLoop, as_trajectory, build_agent_context,
                                 build_agent_loop, check_agent_names, register_agent_loop)
from async_rl.agent.episode import AgentLoopOutput, Episode

__all__ = ["AGENT_LOOPS", "AgentContext", "AgentLoop", "AgentLoopOutput", "Episode", "as_trajectory",
           "build_agent_context", "build_agent_loop", "check_agent_names", "register_agent_loop"]
