"""The tool contract, its registry, and tools configured from YAML.

A tool is what an agent loop may call between two model turns. Its life follows one
episode: `create` makes a per-episode instance (a scratch directory, a session, a
counter), `execute` runs one call with the arguments the model wrote, `calc_reward`
scores the instance at the end (optional), `release` frees it. Tools are registered by
name and built from a YAML file (`agent.tools_config`):

    tools:
      - name: python            # registered tool class, or `class: pkg.module:Class`
        config: {timeout_s: 5}  # passed to the constructor
      - name: calculator

The OpenAI function schema (`schema`) is what the chat template shows the model.
"""

from __future__ import annotations

import abc
import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from async_rl.utils.registry import add_to_registry


@dataclass(frozen=True, slots=True, kw_only=True)
class ToolResult:
    """What one tool call returns: text the model reads next, plus bookkeeping."""

    text: str  # appended to the conversation as the tool message (tokens with loss_mask 0)
    error: bool = False  # the call failed (bad arguments, timeout, limit hit); `text` says why
    reward: float | None = None  # a per-call reward, when the tool gives one
    metrics: dict[str, float] = field(default_factory=dict)  # e.g. {"tool/python_wall_s": 0.12}


class BaseTool(abc.ABC):
    """One kind of tool. Subclasses set `name`, `description`, `parameters` (JSON schema of the
    arguments) and implement `execute`; `create`/`calc_reward`/`release` default to no state."""

    name: str = ""
    description: str = ""
    parameters: dict[str, Any] = {"type": "object", "properties": {}}

    def __init__(self, **config: Any):
        self.config = config

    @property
    def schema(self) -> dict[str, Any]:
        """The OpenAI function-tool schema of this tool (what the chat template renders)."""
        return {"type": "function",
                "function": {"name": self.name, "description": self.description, "parameters": self.parameters}}

    def prepare(self) -> None:
        """Check what this tool needs on the machine where its episodes run (an interpreter, an
        isolation mode), once, before the first episode. A launcher that only checks a config skips
        it, since episodes may run on another machine."""

    async def create(self, instance_id: str, **kwargs: Any) -> str:
        """Make the per-episode state of `instance_id` (kwargs come from the sample's `tools_kwargs`)."""
        return instance_id

    @abc.abstractmethod
    async def execute(self, instance_id: str, arguments: dict[str, Any]) -> ToolResult:
        """Run one call. Never raise for a bad call: return `ToolResult(error=True, text=why)`."""

    async def calc_reward(self, instance_id: str) -> float:
        """A score for the whole episode's use of this tool (0 when the tool does not score)."""
        return 0.0

    async def release(self, instance_id: str) -> None:
        """Free what `create` made."""


TOOLS: dict[str, type[BaseTool]] = {}


def register_tool(name: str) -> Callable[[type[BaseTool]], type[BaseTool]]:
    def deco(cls: type[BaseTool]) -> type[BaseTool]:
        cls.name = cls.name or name
        return add_to_registry(TOOLS, "tool", name, cls)
    return deco


def import_object(path: str, what: str) -> Any:
    """`pkg.module:Name` (or `pkg.module.Name`) -> the object; a clear error when it is not there."""
    module_name, _, attr = path.partition(":") if ":" in path else path.rpartition(".")
    if not module_name or not attr:
        raise ValueError(f"{what}: {path!r} is not an import path (expected pkg.module:Name)")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"{what}: cannot import module {module_name!r} ({exc})") from None
    if not hasattr(module, attr):
        raise ValueError(f"{what}: module {module_name!r} has no {attr!r}")
    return getattr(module, attr)


def build_tool(spec: dict[str, Any], where: str = "tools") -> BaseTool:
    """One tool from its YAML entry: `{name, class?, config?}`."""
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
        raise ValueError(f"{where}: each tool needs a `name` string, got {spec!r}")
    unknown = set(spec) - {"name", "class", "config"}
    if unknown:
        raise ValueError(f"{where}.{spec['name']}: unknown key(s) {sorted(unknown)} (allowed: name, class, config)")
    if "class" in spec:
        cls = import_object(spec["class"], f"{where}.{spec['name']}.class")
        if not (isinstance(cls, type) and issubclass(cls, BaseTool)):
            raise ValueError(f"{where}.{spec['name']}.class: {spec['class']!r} is not a BaseTool subclass")
    else:
        _import_builtin_tools()
        if spec["name"] not in TOOLS:
            raise ValueError(f"{where}: unknown tool {spec['name']!r}; registered: {', '.join(sorted(TOOLS))}")
        cls = TOOLS[spec["name"]]
    config = spec.get("config") or {}
    if not isinstance(config, dict):
        raise ValueError(f"{where}.{spec['name']}.config: must be a map, got {type(config).__name__}")
    try:
        tool = cls(**config)
    except TypeError as exc:
        raise ValueError(f"{where}.{spec['name']}.config: {exc}") from None
    tool.name = spec["name"]
    return tool


def load_tools(path: str | Path) -> dict[str, BaseTool]:
    """Every tool of a tools YAML file, by name."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"agent.tools_config: file not found: {p}")
    doc = yaml.safe_load(p.read_text()) or {}
    specs = doc.get("tools") if isinstance(doc, dict) else None
    if not isinstance(specs, list):
        raise ValueError(f"{p}: expected a top-level `tools:` list")
    tools = [build_tool(s, f"{p}:tools") for s in specs]
    names = [t.name for t in tools]
    if len(set(names)) != len(names):
        raise ValueError(f"{p}: tool names must be unique, got {names}")
    return {t.name: t for t in tools}


def _import_builtin_tools() -> None:
    importlib.import_module("async_rl.agent.tools")  # registers the built-in tools
