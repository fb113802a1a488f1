"""Agent loops: per-sample episodes that produce trajectories (single-turn built in)."""

from async_rl.agent import single_turn  # noqa: F401  (registers "single_turn")
from async_rl.agent.base import AGENT_LOOPS, AgentLoop, build_agent_loop, register_agent_loop

__all__ = ["AGENT_LOOPS", "AgentLoop", "build_agent_loop", "register_agent_loop"]
