"""Tool-call parsers (shared by the OpenAI server and the agent loops): the model's text of one turn -> (plain content, tool calls).

Chosen by name (`agent.tool_parser`) from `TOOL_PARSERS`. The built-in `hermes` parser reads
the format of Hermes / Qwen / SmolLM2 chat templates:

    I will compute it.<tool_call>
    {"name": "calculator", "arguments": {"expression": "2+3"}}
    </tool_call>

A call whose JSON is broken, or that has no name, is still returned (with `error` set), so
the loop can answer the model with a tool error instead of silently ignoring it.
"""

from __future__ import annotations

import abc
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True, kw_only=True)
class ToolCall:
    name: str
    arguments: dict[str, Any] = field(default_factory=dict)
    raw: str = ""  # the text the call was parsed from
    error: str | None = None  # why the call could not be parsed (name may be "")
    id: str = ""  # OpenAI tool_call id (set by whoever exposes calls over the OpenAI API)

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": json.dumps(self.arguments, ensure_ascii=False)}}


class ToolParser(abc.ABC):
    """Splits one assistant turn into content and tool calls."""

    @abc.abstractmethod
    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        ...


TOOL_PARSERS: dict[str, type[ToolParser]] = {}


def register_tool_parser(name: str) -> Callable[[type[ToolParser]], type[ToolParser]]:
    def deco(cls: type[ToolParser]) -> type[ToolParser]:
        TOOL_PARSERS[name] = cls
        return cls
    return deco


def build_tool_parser(name: str) -> ToolParser:
    if name not in TOOL_PARSERS:
        raise ValueError(f"agent.tool_parser: unknown parser {name!r}; registered: {', '.join(sorted(TOOL_PARSERS))}")
    return TOOL_PARSERS[name]()


@register_tool_parser("hermes")
class HermesToolParser(ToolParser):
    _CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        if "<tool_call>" not in text:
            return text, []
        calls = [self._one(m.group(1)) for m in self._CALL.finditer(text)]
        content = self._CALL.sub("", text).strip()
        return content, calls

    @staticmethod
    def _one(body: str) -> ToolCall:
        raw = body.strip()
        try:
            obj = json.loads(raw)
        except json.JSONDecodeError as exc:
            return ToolCall(name="", raw=raw, error=f"tool call is not valid JSON ({exc.msg} at char {exc.pos})")
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
            return ToolCall(name="", raw=raw, error='tool call needs {"name": str, "arguments": {...}}')
        args = obj.get("arguments", {})
        if isinstance(args, str):  # some models write the arguments as a JSON string
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                return ToolCall(name=obj["name"], raw=raw, error="tool call arguments are not valid JSON")
        if not isinstance(args, dict):
            return ToolCall(name=obj["name"], raw=raw, error="tool call arguments must be a JSON object")
        return ToolCall(name=obj["name"], arguments=args, raw=raw)
