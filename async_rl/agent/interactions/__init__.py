"""Interactions (simulated users) for multi-turn agent loops: the contract and the built-ins."""

from async_rl.agent.interactions import builtin  # noqa: F401  (registers arith_user, echo_user)
from async_rl.agent.interactions.base import (INTERACTIONS, BaseInteraction, InteractionTurn, load_interactions,
                                              register_interaction)

__all__ = ["INTERACTIONS", "BaseInteraction", "InteractionTurn", "load_interactions", "register_interaction"]
