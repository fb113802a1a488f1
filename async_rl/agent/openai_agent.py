"""Trainable agents written against the OpenAI chat API (the official `openai` client).

Subclass `OpenAIAgentLoop`, implement `episode`, register it, and train it like any loop:

    @register_agent_loop("my_agent")
    class MyAgent(OpenAIAgentLoop):
        async def episode(self, client: openai.AsyncOpenAI, sample: Sample) -> float:
            res = await client.chat.completions.create(model=self.model_name, messages=sample.messages)
            return self.reward_fn(sample, res.choices[0].message.content or "")

`client` is a real `openai.AsyncOpenAI`; its HTTP transport is in process (`openai_session`):
every chat call is templated into token ids and generated through this loop's
`GenerationClient` (the controller's pooled, sticky client), and the episode's session records
the exact ids, log-probs and policy versions sampled. The trajectory is the session's last
chain of calls that extend one another (see `openai_session`): prompt of its first call, then
the sampled ids (mask 1) and the env tokens of the messages added between calls (mask 0). The
reward is what `episode` returns. Any `model` name is accepted; `self.model_name` is a
convention. A generation failure the agent's code swallows still fails the episode.

Loops here register when this module is imported: name it (or the user's module that
subclasses `OpenAIAgentLoop`) in `agent.modules`, e.g. `agent.modules=[async_rl.agent.openai_agent]`.
The example agent `openai_example` asks the sample's question with a `calculator` tool,
answers the model's tool calls itself with the built-in calculator, and scores the final
answer with the task's reward.
"""

from __future__ import annotations

import abc
import json
import time
from typing import TYPE_CHECKING, Any

import httpx

from async_rl.agent.base import AgentLoop, register_agent_loop
from async_rl.agent.episode import AgentLoopOutput
from async_rl.agent.openai_session import ChatSession, SessionTransport
from async_rl.agent.tools.base import BaseTool
from async_rl.agent.tools.calculator import CalculatorTool
from async_rl.tool_parsers import build_tool_parser
from async_rl.types import Sample, SamplingParams, new_id

if TYPE_CHECKING:
    import openai

BASE_URL = "http://agent-session.invalid/v1"  # never resolved: the transport answers in process


def _openai() -> Any:
    """The `openai` package, an extra: imported where an episode first needs its client."""
    try:
        import openai
    except ImportError:
        raise ImportError("OpenAIAgentLoop needs the `openai` package: pip install 'async_rl[openai]'") from None
    return openai


class OpenAIAgentLoop(AgentLoop):
    """An agent loop whose episode is user code driving an `openai.AsyncOpenAI` client."""

    model_name = "policy"  # what agents pass as `model` (the session serves whatever the servers serve)

    @abc.abstractmethod
    async def episode(self, client: openai.AsyncOpenAI, sample: Sample) -> float:
        """Play one episode through `client`; return its reward."""

    def session(self, sampling_params: SamplingParams) -> ChatSession:
        cfg = self.context.config
        parser = self.context.tool_parser or build_tool_parser("hermes")
        return ChatSession(self.client, self.tokenizer, parser, sampling_params,
                           max_response_tokens=cfg.max_response_tokens if cfg is not None else 512,
                           max_calls=cfg.max_assistant_turns if cfg is not None else 4, model_name=self.model_name)

    async def run(self, sample: Sample, sampling_params: SamplingParams, *, group_id: str) -> AgentLoopOutput:
        session = self.session(sampling_params)
        t0 = time.perf_counter()
        oai = _openai().AsyncOpenAI(base_url=BASE_URL, api_key="x", max_retries=0,
                                 http_client=httpx.AsyncClient(transport=SessionTransport(session)))
        try:
            reward = await self.episode(oai, sample)
        except Exception:
            if session.failure is not None:  # the client only saw "connection error": say what happened
                raise session.failure from None
            raise
        finally:
            await oai.close()
        if session.failure is not None:
            raise session.failure
        if isinstance(reward, bool) or not isinstance(reward, (int, float)):
            raise TypeError(f"{type(self).__name__}.episode returned {type(reward).__name__}, expected a float reward")
        out = session.output(reward=float(reward), timings={"episode_s": time.perf_counter() - t0},
                             info={"sample_id": sample.id})
        if self.context.trace is not None:
            self.context.trace(_trace(sample, type(self).__name__, session, out))
        return out


def _trace(sample: Sample, agent: str, session: ChatSession, out: AgentLoopOutput) -> dict[str, Any]:
    calls = [{"chain": c.chain, "prompt_tokens": len(c.prompt_ids), "sampled_tokens": len(c.output.output_ids),
              "content": c.reply.get("content"), "tool_calls": c.reply.get("tool_calls", []),
              "finish_reason": c.finish_reason,
              "versions": [min(c.output.output_versions), max(c.output.output_versions)]
              if c.output.output_versions else []} for c in session.calls]
    return {"sample_id": sample.id, "agent": agent, "calls": calls,
            "turns": [{"role": t.role, "mask": [t.start, t.end]} for t in out.turns],
            "reward": out.reward, "finish_reason": out.finish_reason, "metrics": out.metrics,
            "total_tokens": len(out.prompt_ids) + len(out.response_ids)}


# --------------------------------------------------------------------------- the example agent
@register_agent_loop("openai_example")
class OpenAIExampleAgent(OpenAIAgentLoop):
    """Ask the question with a calculator tool; run the calls the model makes; score its final answer.

    The calculator runs here, in the agent (the run's configured `calculator` tool when there is
    one, else a default `CalculatorTool`); other tool names get an error message."""

    async def episode(self, client: openai.AsyncOpenAI, sample: Sample) -> float:
        calc = self.context.tools.get("calculator") or CalculatorTool()
        instance = await calc.create(new_id())
        try:
            return await self.converse(client, sample, calc, instance)
        finally:
            await calc.release(instance)

    async def converse(self, client: openai.AsyncOpenAI, sample: Sample, calc: BaseTool, instance: str) -> float:
        messages: list[Any] = list(sample.messages or [{"role": "user", "content": sample.prompt or ""}])
        while True:  # the session bounds the calls (agent.max_assistant_turns): past it, no tool calls come back
            res = await client.chat.completions.create(model=self.model_name, messages=messages,
                                                       tools=[calc.schema])
            message = res.choices[0].message
            if not message.tool_calls:
                return self.reward_fn(sample, message.content or "")
            messages.append(message.model_dump(exclude_none=True))
            for call in message.tool_calls:
                messages.append({"role": "tool", "tool_call_id": call.id, "name": call.function.name,
                                 "content": await self.run_tool(calc, instance, call.function)})

    @staticmethod
    async def run_tool(calc: BaseTool, instance: str, function: Any) -> str:
        if function.name != calc.name:
            return f"error: unknown tool {function.name!r}; available: {calc.name}"
        try:
            args = json.loads(function.arguments)
        except json.JSONDecodeError:
            return "error: the arguments are not valid JSON"
        return (await calc.execute(instance, args if isinstance(args, dict) else {})).text
