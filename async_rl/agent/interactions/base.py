"""The interaction contract (simulated users, environments that talk back) and its YAML registry.

An interaction plays the other side of a multi-turn conversation. The tool agent loop calls
it whenever the model ends a turn without a tool call:

    await interaction.start_interaction(instance_id, **sample.info["interaction_kwargs"])
    turn = await interaction.generate_response(instance_id, messages)
    # turn.done: end the episode; turn.reply: the user's next message (tokens with loss_mask 0);
    # turn.score: this turn's score (kept per turn, available to the reward and the advantages)
    final = await interaction.calculate_score(instance_id)
    await interaction.finalize_interaction(instance_id)

Interactions are named in a YAML file (`agent.interactions_config`), and a sample picks one
by name (`sample.info["interaction"]`):

    interactions:
      - name: arith_tutor                 # the name samples use
        class: async_rl.agent.interactions.builtin:ArithTutor   # or `type:` a registered class
        config: {max_hints: 2}
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from async_rl.agent.tools.base import import_object
from async_rl.utils.registry import registrar


@dataclass(frozen=True, slots=True, kw_only=True)
class InteractionTurn:
    done: bool  # end the episode after this turn
    reply: str = ""  # the next user message ("" with done=True: nothing more is said)
    score: float = 0.0  # score of the model's last turn
    extra: dict[str, Any] = field(default_factory=dict)


class BaseInteraction(abc.ABC):
    def __init__(self, name: str = "", **config: Any):
        self.name = name
        self.config = config

    async def start_interaction(self, instance_id: str, **kwargs: Any) -> str:
        return instance_id

    @abc.abstractmethod
    async def generate_response(self, instance_id: str, messages: list[dict[str, Any]],
                                **kwargs: Any) -> InteractionTurn:
        """Answer the conversation so far (its last message is the model's turn)."""

    async def calculate_score(self, instance_id: str) -> float:
        """The episode's score (0 when the interaction does not score)."""
        return 0.0

    async def finalize_interaction(self, instance_id: str) -> None:
        """Free what `start_interaction` made."""


INTERACTIONS: dict[str, type[BaseInteraction]] = {}


register_interaction = registrar(INTERACTIONS, "interaction")  # @register_interaction("name") on a BaseInteraction


def load_interactions(path: str | Path) -> dict[str, BaseInteraction]:
    """Every interaction of an interactions YAML file, by name."""
    import async_rl.agent.interactions  # noqa: F401  (registers the built-ins)

    p = Path(path)
    if not p.is_file():
        raise ValueError(f"agent.interactions_config: file not found: {p}")
    doc = yaml.safe_load(p.read_text()) or {}
    specs = doc.get("interactions") if isinstance(doc, dict) else None
    if not isinstance(specs, list):
        raise ValueError(f"{p}: expected a top-level `interactions:` list")
    out: dict[str, BaseInteraction] = {}
    for spec in specs:
        where = f"{p}:interactions"
        if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
            raise ValueError(f"{where}: each interaction needs a `name` string, got {spec!r}")
        name = spec["name"]
        unknown = set(spec) - {"name", "class", "type", "config"}
        if unknown:
            raise ValueError(f"{where}.{name}: unknown key(s) {sorted(unknown)} (allowed: name, class, type, config)")
        if "class" in spec:
            cls = import_object(spec["class"], f"{where}.{name}.class")
        else:
            kind = spec.get("type", name)
            if kind not in INTERACTIONS:
                raise ValueError(f"{where}.{name}: unknown interaction type {kind!r}; registered: "
                                 f"{', '.join(sorted(INTERACTIONS))}")
            cls = INTERACTIONS[kind]
        if not (isinstance(cls, type) and issubclass(cls, BaseInteraction)):
            raise ValueError(f"{where}.{name}: {cls!r} is not a BaseInteraction subclass")
        if name in out:
            raise ValueError(f"{where}: interaction {name!r} is defined twice")
        config = spec.get("config") or {}
        if not isinstance(config, dict):
            raise ValueError(f"{where}.{name}.config: must be a map")
        try:
            out[name] = cls(name=name, **config)
        except TypeError as exc:
            raise ValueError(f"{where}.{name}.config: {exc}") from None
    return out
