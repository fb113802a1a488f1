"""Running one assistant turn's tool calls: concurrently, and never raising.

Every call ends as a `CallOutcome` whose `text` is what the model reads next: the tool's own
answer, or an error message when the call could not be parsed, names a tool this sample may
not use, has arguments that break the tool's schema (missing required keys, unknown keys where
the schema forbids them, wrong JSON types), raises, or is beyond `max_parallel` calls in one
turn. The tool agent loop turns the outcomes into tool messages.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from async_rl.agent.tools.base import BaseTool, ToolResult
from async_rl.tool_parsers import ToolCall

logger = logging.getLogger(__name__)

_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,), "integer": (int,), "number": (int, float), "boolean": (bool,),
    "array": (list,), "object": (dict,), "null": (type(None),),
}


@dataclass(frozen=True, slots=True, kw_only=True)
class CallOutcome:
    name: str
    arguments: dict[str, Any]
    text: str  # the tool message's content
    error: bool = False
    reward: float | None = None
    seconds: float = 0.0
    started: float = 0.0  # time.perf_counter() when the call began (traces; overlap checks)
    metrics: dict[str, float] = field(default_factory=dict)


def check_arguments(schema: dict[str, Any], arguments: dict[str, Any]) -> str | None:
    """Why `arguments` do not fit the tool's JSON schema (top level only), or None when they do."""
    props = schema.get("properties") or {}
    missing = [k for k in schema.get("required") or [] if k not in arguments]
    if missing:
        return f"missing required argument(s) {missing}"
    if schema.get("additionalProperties") is False:
        unknown = sorted(set(arguments) - set(props))
        if unknown:
            return f"unknown argument(s) {unknown} (allowed: {sorted(props)})"
    for key, value in arguments.items():
        kind = (props.get(key) or {}).get("type")
        kinds = [kind] if isinstance(kind, str) else list(kind or [])
        allowed = tuple(t for k in kinds for t in _JSON_TYPES.get(k, ()))
        if allowed and (not isinstance(value, allowed) or (isinstance(value, bool) and bool not in allowed)):
            return f"argument {key!r} must be {' or '.join(kinds)}, got {type(value).__name__}"
    return None


async def _run_one(call: ToolCall, tools: dict[str, BaseTool], instances: dict[str, str]) -> CallOutcome:
    t0 = time.perf_counter()

    def outcome(text: str, error: bool = True, result: ToolResult | None = None) -> CallOutcome:
        return CallOutcome(name=call.name, arguments=dict(call.arguments), text=text, error=error,
                           reward=None if result is None else result.reward, seconds=time.perf_counter() - t0,
                           started=t0, metrics={} if result is None else dict(result.metrics))

    if call.error:
        return outcome(f"Error: {call.error}")
    tool = tools.get(call.name)
    if tool is None:
        return outcome(f"Error: unknown tool {call.name!r}; available: {', '.join(sorted(tools)) or 'none'}")
    problem = check_arguments(tool.parameters, call.arguments)
    if problem:
        return outcome(f"Error: {call.name}: {problem}")
    try:
        result = await tool.execute(instances[call.name], dict(call.arguments))
    except Exception as exc:  # a tool bug must not end the episode: the model reads the error instead
        logger.warning("tool %r raised %s: %s", call.name, type(exc).__name__, exc)
        return outcome(f"Error: tool {call.name!r} failed: {type(exc).__name__}: {exc}")
    if not isinstance(result, ToolResult):
        return outcome(f"Error: tool {call.name!r} returned {type(result).__name__}, not a ToolResult")
    return outcome(result.text, error=result.error, result=result)


async def run_tool_calls(calls: list[ToolCall], tools: dict[str, BaseTool], instances: dict[str, str],
                         max_parallel: int) -> list[CallOutcome]:
    """All calls of one turn, the first `max_parallel` concurrently; outcomes in call order."""
    ran = list(await asyncio.gather(*(_run_one(c, tools, instances) for c in calls[:max_parallel])))
    refused = [CallOutcome(name=c.name, arguments=dict(c.arguments), error=True, started=time.perf_counter(),
                           text=f"Error: too many tool calls in one turn (at most {max_parallel} run); "
                                "this call was not run")
               for c in calls[max_parallel:]]
    return ran + refused
