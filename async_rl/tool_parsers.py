"""Tool-call parsers (shared by the OpenAI server and the agent loops): the model's text of one turn -> (plain content, tool calls).

Chosen by name (`agent.tool_parser`) from `TOOL_PARSERS`. The built-in `hermes` parser reads
the format of Hermes / Qwen / SmolLM2 chat templates:

    I will compute it.<tool_call>
    {"name": "calculator", "arguments": {"expression": "2+3"}}
    </tool_call>

A call whose JSON is broken, or that has no name, is still returned (with `error` set), so
the loop can answer the model with a tool error instead of silently ignoring it.

`render` is a parser's inverse (calls -> the model's text). The OpenAI chat API's view of tool
calls lives here too, so the server and the OpenAI-client agents' session agree:
`openai_assistant_message` (generated text -> assistant message with `tool_calls`) and
`chat_template_messages` (request messages, with `tool_calls` and `tool` turns -> template input).
"""

from __future__ import annotations

import abc
import json
import re
import uuid
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

    def render(self, calls: list[ToolCall]) -> str:
        """The text a model of this format writes for `calls` (a broken call: its raw text)."""
        raise NotImplementedError(f"{type(self).__name__}: cannot write tool calls as text")


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

    def render(self, calls: list[ToolCall]) -> str:
        bodies = [c.raw if c.error is not None else json.dumps({"name": c.name, "arguments": c.arguments},
                                                                ensure_ascii=False) for c in calls]
        return "\n".join(f"<tool_call>\n{b}\n</tool_call>" for b in bodies)

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


# --------------------------------------------------------------------------- the OpenAI chat API's view of tool calls
# Shared by the server's /v1/chat/completions and the in-process session of OpenAI-client agents,
# so both turn text into `tool_calls` and incoming `tool_calls` into template input alike.

def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def openai_assistant_message(text: str, parser: ToolParser, finish_reason: str) -> tuple[dict[str, Any], str]:
    """One generated turn as an OpenAI assistant message, and the OpenAI finish reason.

    Well-formed calls become `tool_calls` (fresh `call_<hex>` ids, arguments as a JSON string) and
    their markup leaves `content` (None when nothing is left); a call the parser marks as broken stays
    in `content` as text (re-rendered after the rest), so the caller sees what the model wrote. The
    finish reason is "tool_calls" when the turn ended by itself ("stop") with at least one call."""
    content, calls = parser.parse(text)
    good = [c for c in calls if c.error is None]
    broken = [c for c in calls if c.error is not None]
    if broken:
        content = "\n".join(p for p in (content, parser.render(broken)) if p)
    message: dict[str, Any] = {"role": "assistant", "content": content or None}
    if good:
        message["tool_calls"] = [ToolCall(name=c.name, arguments=c.arguments, id=new_call_id()).to_openai()
                                 for c in good]
    return message, ("tool_calls" if good and finish_reason == "stop" else finish_reason)


def template_knows_tool_calls(chat_template: Any) -> bool:
    """Does a chat template render assistant `tool_calls` itself (else they are rendered as text)?"""
    return "tool_calls" in str(chat_template or "")


def chat_template_messages(raw: Any, parser: ToolParser, knows_tool_calls: bool) -> list[dict[str, Any]]:
    """OpenAI request messages -> what `apply_chat_template` takes; ValueError names the bad field.

    Content becomes a string (text parts joined, None -> ""). An assistant message's `tool_calls`
    get their arguments as a dict (what chat templates expect); for a template that does not render
    `tool_calls` they are written into the content in the parser's own format instead, so the model
    sees the calls it made. `tool` messages keep `tool_call_id` / `name` for templates that use them."""
    if not isinstance(raw, list) or not raw:
        raise ValueError("messages: must be a non-empty list")
    out = []
    for i, m in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise ValueError(f"{where}: must be an object with a role")
        if not isinstance(m.get("role"), str) or not m["role"]:
            raise ValueError(f"{where}.role: required (a string)")
        msg = {k: v for k, v in m.items() if v is not None}
        msg["content"] = _content(m.get("content"), where)
        if m.get("tool_calls"):
            calls = _incoming_calls(m["tool_calls"], f"{where}.tool_calls")
            if knows_tool_calls:
                msg["tool_calls"] = [{"id": c.id, "type": "function",
                                      "function": {"name": c.name, "arguments": c.arguments}} for c in calls]
            else:
                del msg["tool_calls"]
                msg["content"] = "\n".join(p for p in (msg["content"], parser.render(calls)) if p)
        out.append(msg)
    return out


def _content(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError(f"{where}.content: must be a string or a list of text parts")
    parts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise ValueError(f"{where}.content[{j}]: only {{'type': 'text', 'text': ...}} parts are supported")
        parts.append(part["text"])
    return "".join(parts)


def _incoming_calls(raw: Any, where: str) -> list[ToolCall]:
    if not isinstance(raw, list):
        raise ValueError(f"{where}: must be a list")
    calls = []
    for j, c in enumerate(raw):
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ValueError(f"{where}[{j}].function.name: required (a string)")
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError as exc:
                raise ValueError(f"{where}[{j}].function.arguments: not valid JSON ({exc.msg})") from None
        if not isinstance(args, dict):
            raise ValueError(f"{where}[{j}].function.arguments: must be a JSON object")
        calls.append(ToolCall(name=fn["name"], arguments=args, id=str(c.get("id") or "")))
    return calls
