"""The per-episode session behind a trainable OpenAI-client agent: chat calls in, exact tokens recorded.

An `OpenAIAgentLoop` hands its user code an `openai.AsyncOpenAI` whose HTTP transport is
`SessionTransport`: `POST /v1/chat/completions` never leaves the process. `ChatSession.complete`
templates the request's messages (and tools) into token ids, generates through the loop's
`GenerationClient` (the pooled, sticky client: real servers, real policy versions), records
exactly the ids, log-probs and versions sampled, and answers like the server does (tool calls
parsed into `tool_calls`, see `async_rl.tool_parsers.openai_assistant_message`).

The trajectory is built from tokens, never from text. Calls form *chains*: when call k+1's
messages are call k's messages plus the assistant message the session returned, plus new
messages (compared structurally, after the same normalisation the template input gets), its
prompt is call k's prompt + call k's sampled ids + the env tokens of the new messages
(`chat_tokens.env_ids_after_turn`: the template rendered as text with and without them, only the
difference tokenised). Any other call (different history or tools, or a template that rewrites
history) starts a new chain. Only the last chain is trained; calls of earlier chains are counted
in `dropped_calls`.

Limits: non-streaming, n = 1 (stream=true or n > 1 is a 400). The run's sampling parameters
decide how tokens are sampled (the trainer assumes them); a request's `temperature`, `top_p`,
`seed`... are ignored, its `max_tokens` / `max_completion_tokens` and `stop` apply. Once the
chain's response budget (`agent.max_response_tokens`) or the episode's call budget
(`agent.max_assistant_turns`) is spent, calls answer at once with no tokens and
finish_reason "length". `logprobs` are not returned (the tokens are recorded here instead).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from dataclasses import dataclass
from typing import Any

import httpx

from async_rl.agent.chat_tokens import ChatTemplateError, env_ids_after_turn, stop_token_of_turn
from async_rl.agent.episode import AgentLoopOutput, Episode
from async_rl.models import chat_prompt_ids
from async_rl.protocols import GenerationClient
from async_rl.tool_parsers import (ToolParser, chat_template_messages, openai_assistant_message,
                                   template_knows_tool_calls)
from async_rl.types import GenerationOutput, SamplingParams, new_id
from async_rl.utils.seeding import derive_seed

logger = logging.getLogger(__name__)

ROUTE = "/v1/chat/completions"


class SessionRequestError(ValueError):
    """A chat request the session cannot serve (answered 400 with this message)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class SessionCall:
    """One chat call as the session served it."""

    chain: int  # which chain it belongs to (only the last one is trained)
    prompt_ids: list[int]
    output: GenerationOutput  # exactly what the server sampled (ids, log-probs, versions)
    reply: dict[str, Any]  # the assistant message returned
    finish_reason: str  # as returned (OpenAI's: tool_calls | stop | length | abort)


class _Chain:
    """The token record of calls that extend one another, and the messages it stands for."""

    def __init__(self, index: int, prompt_ids: list[int], max_response_tokens: int,
                 tools: list[dict[str, Any]] | None):
        self.index = index
        self.episode = Episode(prompt_ids, max_response_tokens)
        self.tools = tools
        self.seen: list[str] = []  # canonical messages so far, the returned assistant replies included
        self.rendered: list[dict[str, Any]] = []  # template input; assistant turns as the model wrote them
        self.sampled_tail = ""  # text of the stop token that ended the last turn ("" if none)
        self.calls = 0


def _canonical(messages: list[dict[str, Any]]) -> list[str]:
    """Messages reduced to what the template sees, as comparable strings (None fields, extras dropped)."""
    keys = ("role", "content", "tool_calls", "tool_call_id", "name")
    return [json.dumps({k: m[k] for k in keys if m.get(k) not in (None, "", [])}, sort_keys=True) for m in messages]


class ChatSession:
    """Serves one episode's chat calls and keeps its token record (see the module docstring)."""

    def __init__(self, client: GenerationClient, tokenizer: Any, parser: ToolParser, params: SamplingParams, *,
                 max_response_tokens: int, max_calls: int, model_name: str = "policy"):
        self.client, self.tokenizer, self.parser, self.params = client, tokenizer, parser, params
        self.max_response_tokens, self.max_calls, self.model_name = max_response_tokens, max_calls, model_name
        self.knows_tool_calls = template_knows_tool_calls(getattr(tokenizer, "chat_template", None))
        self.calls: list[SessionCall] = []
        self.chain: _Chain | None = None
        self.failure: BaseException | None = None  # a generation error the agent's code may have swallowed
        self.generate_s = 0.0
        self.template_breaks = 0

    # ------------------------------------------------------------------ one call
    async def complete(self, body: Any) -> dict[str, Any]:
        """One `/v1/chat/completions` request body -> the OpenAI response body."""
        messages, tools, max_new, stops = self._check(body)
        chain = self._place(messages, tools)
        budget = min(max_new, chain.episode.remaining) if not chain.episode.truncated else 0
        prompt = chain.episode.context_ids
        if budget <= 0 or len(self.calls) >= self.max_calls:
            out = GenerationOutput(request_id=new_id(), prompt_len=len(prompt), output_ids=[], output_logprobs=[],
                                   output_versions=[], finish_reason="length")
        else:
            out = await self._generate(prompt, budget, stops)
        kept = chain.episode.add_model_turn(out)
        ended = "length" if len(kept) < len(out.output_ids) else out.finish_reason
        text = self.tokenizer.decode(kept, skip_special_tokens=True)
        content = _cut_at_stop(text, stops)
        reply, reason = openai_assistant_message(content, self.parser, ended) if tools \
            else ({"role": "assistant", "content": content}, ended)
        chain.seen += _canonical(self._template_input([reply]))
        chain.rendered.append({"role": "assistant", "content": text})
        stop_id = stop_token_of_turn(self.tokenizer, kept, ended, self.params.stop_token_ids)
        chain.sampled_tail = "" if stop_id is None else self.tokenizer.decode([stop_id], skip_special_tokens=False)
        chain.calls += 1
        self.calls.append(SessionCall(chain=chain.index, prompt_ids=prompt, output=out, reply=reply,
                                      finish_reason=reason))
        return self._response(body, prompt, kept, reply, reason)

    def _check(self, body: Any) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None, int, tuple[str, ...]]:
        if not isinstance(body, dict):
            raise SessionRequestError("request body: must be a JSON object")
        if body.get("stream"):
            raise SessionRequestError("stream: not supported by the agent session; call with stream=false")
        if body.get("n") not in (None, 1):
            raise SessionRequestError(f"n: the agent session samples one choice per call, got n={body['n']}")
        tools = body.get("tools") or None
        if tools is not None and not isinstance(tools, list):
            raise SessionRequestError("tools: must be a list of tool definitions")
        limit = body.get("max_completion_tokens", body.get("max_tokens"))
        if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 1):
            raise SessionRequestError(f"max_tokens: must be a positive integer, got {limit!r}")
        stop = body.get("stop") or []
        stops = (stop,) if isinstance(stop, str) else tuple(stop)
        if not all(isinstance(s, str) and s for s in stops):
            raise SessionRequestError("stop: must be a string or a list of non-empty strings")
        messages = self._template_input(body.get("messages"))
        max_new = self.params.max_new_tokens if limit is None else min(limit, self.params.max_new_tokens)
        return messages, tools, max_new, stops

    def _template_input(self, messages: Any) -> list[dict[str, Any]]:
        try:
            return chat_template_messages(messages, self.parser, self.knows_tool_calls)
        except ValueError as exc:
            raise SessionRequestError(str(exc)) from None

    def _place(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> _Chain:
        """The chain this call extends (its env tokens appended), or a new one."""
        chain, seen = self.chain, _canonical(messages)
        if chain is not None and chain.tools == tools and seen[:len(chain.seen)] == chain.seen:
            new = messages[len(chain.seen):]
            try:
                env = env_ids_after_turn(self.tokenizer, chain.rendered, new, tools=tools,
                                         sampled_tail=chain.sampled_tail)
            except ChatTemplateError as exc:
                self.template_breaks += 1
                logger.warning("chat call starts a new chain (only the last one is trained): %s", exc)
            else:
                role = new[-1]["role"] if new else "template"
                chain.episode.add_env_tokens(env, role=role)
                chain.seen, chain.rendered = seen, chain.rendered + new
                return chain
        try:
            prompt = chat_prompt_ids(self.tokenizer, messages, tools)
        except Exception as exc:  # jinja errors of a template that does not fit these messages
            raise SessionRequestError(f"messages: the chat template failed: {exc}") from None
        self.chain = _Chain(0 if chain is None else chain.index + 1, prompt, self.max_response_tokens, tools)
        self.chain.seen, self.chain.rendered = seen, list(messages)
        return self.chain

    async def _generate(self, prompt: list[int], budget: int, stops: tuple[str, ...]) -> GenerationOutput:
        seed = None if self.params.seed is None else derive_seed(self.params.seed, "openai-call", len(self.calls))
        params = dataclasses.replace(self.params, max_new_tokens=budget, n=1, seed=seed,
                                     stop=tuple(dict.fromkeys(self.params.stop + stops)))
        t0 = time.perf_counter()
        try:
            return await self.client.generate(prompt, params)
        except ValueError as exc:  # the server refused the request (e.g. the prompt outgrew the context)
            raise SessionRequestError(str(exc)) from None
        except Exception as exc:
            self.failure = exc
            raise
        finally:
            self.generate_s += time.perf_counter() - t0

    def _response(self, body: dict[str, Any], prompt: list[int], kept: list[int], reply: dict[str, Any],
                  reason: str) -> dict[str, Any]:
        return {"id": "chatcmpl-" + new_id(), "object": "chat.completion", "created": int(time.time()),
                "model": body.get("model") or self.model_name,
                "choices": [{"index": 0, "message": reply, "logprobs": None, "finish_reason": reason,
                             "token_ids": kept}],
                "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(kept),
                          "total_tokens": len(prompt) + len(kept)},
                "prompt_token_ids": prompt}

    # ------------------------------------------------------------------ the episode's record
    def output(self, *, reward: float, timings: dict[str, float] | None = None,
               info: dict[str, Any] | None = None) -> AgentLoopOutput:
        """The last chain as the trainable output (ValueError if the agent made no call)."""
        if self.chain is None:
            raise ValueError("the OpenAI agent's episode made no chat call: nothing to train")
        last = self.chain.index
        metrics = {"calls": len(self.calls), "chains": last + 1,
                   "dropped_calls": sum(1 for c in self.calls if c.chain != last),
                   "tool_calls": sum(len(c.reply.get("tool_calls", [])) for c in self.calls),
                   "template_breaks": self.template_breaks}
        return self.chain.episode.output(reward=reward, metrics=metrics,
                                         timings={"generate_s": self.generate_s, **(timings or {})}, info=info)


def _cut_at_stop(text: str, stops: tuple[str, ...]) -> str:
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return text[:min(hits)] if hits else text


def _error(status: int, message: str) -> httpx.Response:
    return httpx.Response(status, json={"error": {"message": message, "type": "invalid_request_error",
                                                  "param": None, "code": None}})


class SessionTransport(httpx.AsyncBaseTransport):
    """httpx transport that answers `POST /v1/chat/completions` from a `ChatSession`, in process."""

    def __init__(self, session: ChatSession):
        self.session = session

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.method != "POST" or request.url.path != ROUTE:
            return _error(404, f"{request.method} {request.url.path}: the agent session serves only POST {ROUTE}")
        try:
            body = json.loads(await request.aread())
        except json.JSONDecodeError as exc:
            return _error(400, f"request body: not valid JSON ({exc.msg})")
        try:
            return httpx.Response(200, json=await self.session.complete(body))
        except SessionRequestError as exc:
            return _error(400, str(exc))
