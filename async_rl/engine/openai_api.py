"""OpenAI-compatible routes on the engine's app: /v1/chat/completions, /v1/completions, /v1/models.

Chat prompts go through the tokenizer's chat template (`async_rl.models.chat_prompt_ids`,
with `tools` passed to it). Supported: `stream` (server-sent events, `stream_options.
include_usage`), `usage`, `logprobs` + `top_logprobs`, `stop`, `max_tokens` /
`max_completion_tokens`, `temperature`, `top_p`, `seed`, `n` (n > 1 only without
streaming), `presence_penalty` / `frequency_penalty` (OpenAI's meaning and range [-2, 2]:
minus the penalty once a token is in the output, minus it per occurrence; the reported
log-probs stay the policy's), `logit_bias`, and the vLLM/SGLang extensions of
`async_rl.engine.openai_fields` (`top_k`, `min_p`, `repetition_penalty`, `min_tokens`,
`ignore_eos`, `stop_token_ids`, `skip_special_tokens`, `include_stop_str_in_output`, ...):
applied, or, where the engine cannot honour one, refused naming it unless it holds its neutral
value. Fields neither vLLM nor SGLang knows are refused (400).

For RL, every answer also carries the exact tokens: `prompt_token_ids` (top level),
and per choice `token_ids` and `meta_info` (per-token policy versions and log-probs, as
in the native /generate). Stop strings are cut from `content`/`text`, never from
`token_ids`. The request's `model` is not checked: the server serves one model.

Tool calls (when the request carries `tools`): the generated text is read by the parser
named in `engine.tool_parser` (`async_rl.tool_parsers`); well-formed calls come back as
`message.tool_calls` (ids `call_<hex>`, `function.arguments` a JSON string) with their markup
removed from `content` (null when nothing else was said) and `finish_reason: "tool_calls"`
(when the turn ended by itself); a call the parser cannot read stays in `content` as text.
With `stream: true` and tools the answer is buffered: the role chunk, then one delta holding
all the content and `tool_calls` (and the turn's `token_ids`) at the end, then the finish chunk.
Requests without `tools` stream and answer exactly as before. Incoming assistant messages with
`tool_calls` and `tool` messages go to the chat template; a template that does not render
`tool_calls` gets them written into the assistant's content in the parser's format.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from pydantic import StrictInt

from async_rl.engine.async_engine import AsyncEngine, RequestHandle
from async_rl.engine.llm_engine import EngineInputError
from async_rl.engine.http_common import ApiError, finish_all_or_disconnect, sse
from async_rl.engine.openai_fields import (ChatExtensions, ChatUnsupported, SamplingExtensions, Unsupported,
                                           keeps_stop_string, refuse_unhonoured, sampling_wire, template_kwargs)
from async_rl.engine.sglang_api import meta_info
from async_rl.models import chat_prompt_ids
from async_rl.tool_parsers import (ToolParser, build_tool_parser, chat_template_messages, openai_assistant_message,
                                   template_knows_tool_calls)
from async_rl.types import GenerationOutput, SamplingParams, new_id

MAX_N = 64  # most choices one request may ask for


class _Common(SamplingExtensions, Unsupported):
    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: StrictInt | None = None
    n: StrictInt = 1
    stop: str | list[str] | None = None
    stream: bool = False
    presence_penalty: float | None = None
    frequency_penalty: float | None = None


class ChatRequest(_Common, ChatExtensions, ChatUnsupported):
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None  # accepted; the model decides (no constrained decoding)
    parallel_tool_calls: bool | None = None
    max_tokens: StrictInt | None = None
    max_completion_tokens: StrictInt | None = None
    logprobs: bool = False
    top_logprobs: StrictInt | None = None


class CompletionRequest(_Common):
    prompt: str | list[StrictInt] | list[str] | list[list[StrictInt]]
    max_tokens: StrictInt | None = 16
    logprobs: StrictInt | None = None  # legacy API: how many top tokens per position (0 = only the sampled one)
    echo: bool = False
    add_special_tokens: bool = True  # the tokenizer's BOS etc. around a text prompt


def _cut_at_stop(text: str, stops: list[str], keep: bool = False) -> str:
    """The text up to the first stop string (through it with `keep`)."""
    hits = [(i, len(s)) for s in stops if (i := text.find(s)) >= 0]
    if not hits:
        return text
    at, length = min(hits)
    return text[:at + length] if keep else text[:at]


class _TextStream:
    """Incremental detokenisation: text not yet sent, holding back what may still become a stop
    string or an incomplete UTF-8 character."""

    def __init__(self, tokenizer: Any, req: _Common):
        self.tokenizer, self.stops, self.req = tokenizer, _OpenAI.stops(req), req
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.ids: list[int] = []
        self.sent = 0

    def push(self, ids: list[int], final: bool) -> str:
        self.ids += ids
        text = _cut_at_stop(self.tokenizer.decode(self.ids, skip_special_tokens=self.req.skip_special_tokens),
                            self.stops, keeps_stop_string(self.req))
        safe = len(text) if final else len(text.rstrip("\ufffd")) - self.hold
        piece = text[self.sent:max(self.sent, safe)]
        self.sent += len(piece)
        return piece


class _OpenAI:
    def __init__(self, engine: AsyncEngine, tokenizer: Any, model_name: str, parser: ToolParser):
        self.engine, self.tokenizer, self.model_name, self.parser = engine, tokenizer, model_name, parser

    # ------------------------------------------------------------------ shared
    def tok(self, field: str) -> Any:
        if self.tokenizer is None:
            raise ApiError(400, f"{field}: this server has no tokenizer; use /generate with input_ids")
        return self.tokenizer

    def sampling(self, req: _Common, prompt_len: int, max_new: int | None, top: int,
                 seed: int | None) -> SamplingParams:
        if max_new is None:  # OpenAI's default: as long as the context allows
            max_new = max(1, min(self.engine.max_context - prompt_len, self.engine.max_new_tokens_limit))
        wire = {"max_new_tokens": max_new, "temperature": 1.0 if req.temperature is None else req.temperature,
                "top_p": 1.0 if req.top_p is None else req.top_p, "stop": self.stops(req), "seed": seed,
                "top_logprobs": top, "presence_penalty": req.presence_penalty,
                "frequency_penalty": req.frequency_penalty, **sampling_wire(req)}
        try:
            return SamplingParams.from_wire(wire)
        except ValueError as exc:
            raise ApiError(400, _openai_names(str(exc))) from None

    @staticmethod
    def stops(req: _Common) -> list[str]:
        return [req.stop] if isinstance(req.stop, str) else list(req.stop or [])

    async def submit_n(self, rid: str, prompt: list[int], req: _Common, max_new: int | None, top: int,
                       prompt_field: str) -> list[RequestHandle]:
        if not 1 <= req.n <= MAX_N:
            raise ApiError(400, f"n: must be in [1, {MAX_N}], got {req.n}")
        handles: list[RequestHandle] = []
        try:
            for i in range(req.n):
                seed = None if req.seed is None else req.seed + i
                params = self.sampling(req, len(prompt), max_new, top, seed)
                handles.append(await self.engine.submit(f"{rid}-{i}", prompt, params))
        except EngineInputError as exc:
            raise ApiError(400, _openai_names(str(exc)).replace("input_ids", prompt_field)) from None
        finally:
            if len(handles) < req.n:
                for h in handles:
                    await h.aclose()
        return handles

    def base(self, rid: str, kind: str) -> dict[str, Any]:
        return {"id": rid, "object": kind, "created": int(time.time()), "model": self.model_name}

    def extras(self, out: GenerationOutput) -> dict[str, Any]:
        return {"token_ids": out.output_ids, "meta_info": meta_info(out, True, self.engine.weight_version)}

    @staticmethod
    def usage(prompt_len: int, outs: list[GenerationOutput]) -> dict[str, int]:
        done = sum(len(o.output_ids) for o in outs)
        return {"prompt_tokens": prompt_len, "completion_tokens": done, "total_tokens": prompt_len + done}

    def token_str(self, token_id: int, as_id: bool | None = False) -> str:
        return f"token_id:{token_id}" if as_id else self.tokenizer.decode([token_id], skip_special_tokens=False)

    def text(self, ids: list[int], req: _Common) -> str:
        """The answer's text: decoded as the request asks, cut at a stop string (or through it)."""
        return _cut_at_stop(self.tokenizer.decode(ids, skip_special_tokens=req.skip_special_tokens), self.stops(req),
                            keeps_stop_string(req))

    @staticmethod
    def stream_usage(req: _Common, prompt_len: int, done: int) -> dict[str, Any]:
        """vLLM's `stream_options.continuous_usage_stats`: the usage so far, in every chunk."""
        opts = req.stream_options
        if not (opts and opts.continuous_usage_stats):
            return {}
        return {"usage": {"prompt_tokens": prompt_len, "completion_tokens": done, "total_tokens": prompt_len + done}}

    # ------------------------------------------------------------------ chat
    def chat_prompt(self, req: ChatRequest) -> list[int]:
        tok = self.tok("messages")
        try:
            messages = chat_template_messages(req.messages, self.parser, template_knows_tool_calls(tok.chat_template))
        except ValueError as exc:
            raise ApiError(400, str(exc)) from None
        try:
            return chat_prompt_ids(tok, messages, req.tools, **template_kwargs(req))
        except Exception as exc:  # jinja errors of a template that does not fit these messages
            raise ApiError(400, f"messages: the chat template failed: {str(exc).splitlines()[0] if str(exc) else exc!r}") \
                from None

    def chat_logprobs(self, ids: list[int], lps: list[float], tops: list | None,
                      as_ids: bool | None = False) -> dict[str, Any]:
        content = []
        for j, (t, lp) in enumerate(zip(ids, lps)):
            s = self.token_str(t, as_ids)
            alts = [{"token": (a := self.token_str(tid, as_ids)), "logprob": alp, "bytes": list(a.encode())}
                    for tid, alp in (tops[j] if tops else [])]
            content.append({"token": s, "logprob": lp, "bytes": list(s.encode()), "top_logprobs": alts})
        return {"content": content}

    def reply(self, out: GenerationOutput, req: ChatRequest) -> tuple[dict[str, Any], str]:
        """The assistant message of one choice and its finish reason (tool calls parsed when tools were given)."""
        text = self.text(out.output_ids, req)
        if not req.tools:
            return {"role": "assistant", "content": text}, out.finish_reason
        return openai_assistant_message(text, self.parser, out.finish_reason)

    async def chat(self, req: ChatRequest, request: Request) -> Any:
        refuse_unhonoured(req, chat=True)
        prompt = self.chat_prompt(req)
        if req.top_logprobs and not req.logprobs:
            raise ApiError(400, "top_logprobs: needs logprobs=true")
        top = (req.top_logprobs or 0) if req.logprobs else 0
        max_new = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        rid = "chatcmpl-" + new_id()
        if req.stream and req.n != 1:
            raise ApiError(400, "n: only n=1 is supported with stream=true")
        handles = await self.submit_n(rid, prompt, req, max_new, top, "messages")
        if req.stream:
            return StreamingResponse(self.chat_stream(rid, handles[0], req, prompt), media_type="text/event-stream")
        outs = await finish_all_or_disconnect(handles, request)
        if outs is None:
            return Response(status_code=499)
        choices = [{"index": i, "message": message,
                    "logprobs": self.chat_logprobs(o.output_ids, o.output_logprobs, o.output_top_logprobs,
                                                   req.return_tokens_as_token_ids) if req.logprobs else None,
                    "finish_reason": reason, **self.extras(o)}
                   for i, o in enumerate(outs) for message, reason in [self.reply(o, req)]]
        return {**self.base(rid, "chat.completion"), "choices": choices, "usage": self.usage(len(prompt), outs),
                "prompt_token_ids": prompt}

    def buffered_delta(self, out: GenerationOutput, req: ChatRequest) -> tuple[dict[str, Any], str]:
        """The one delta of a buffered stream (a request with tools): all content and the tool calls."""
        message, reason = self.reply(out, req)
        delta: dict[str, Any] = {"content": message["content"]}
        if message.get("tool_calls"):
            delta["tool_calls"] = [{"index": j, **c} for j, c in enumerate(message["tool_calls"])]
        return delta, reason

    async def chat_stream(self, rid: str, handle: RequestHandle, req: ChatRequest,
                          prompt: list[int]) -> AsyncIterator[str]:
        base = self.base(rid, "chat.completion.chunk")
        done = 0

        def chunk(delta: dict[str, Any], **extra: Any) -> str:
            return sse({**base, "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": None,
                                             **extra}], **self.stream_usage(req, len(prompt), done)})
        try:
            yield sse({**base, "prompt_token_ids": prompt, "choices": [
                {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}],
                **self.stream_usage(req, len(prompt), 0)})
            text, as_ids = _TextStream(self.tokenizer, req), req.return_tokens_as_token_ids
            async for d in handle:
                reason = d.output.finish_reason if d.finished else None
                done += len(d.new_token_ids)
                if req.tools:  # buffered: the calls are known only once the turn is complete
                    if d.finished:
                        delta, reason = self.buffered_delta(d.output, req)
                        lp = self.chat_logprobs(d.output.output_ids, d.output.output_logprobs,
                                                d.output.output_top_logprobs, as_ids) if req.logprobs else None
                        yield chunk(delta, logprobs=lp, token_ids=d.output.output_ids)
                else:
                    piece = text.push(d.new_token_ids, d.finished)
                    if d.new_token_ids:
                        lp = self.chat_logprobs(d.new_token_ids, d.new_logprobs, d.new_top_logprobs, as_ids) \
                            if req.logprobs else None
                        yield chunk({"content": piece}, logprobs=lp, token_ids=d.new_token_ids)
                if d.finished:
                    yield chunk({}, finish_reason=reason, meta_info=self.extras(d.output)["meta_info"])
                    if req.stream_options and req.stream_options.include_usage:
                        yield sse({**base, "choices": [], "usage": self.usage(len(prompt), [d.output])})
            yield sse("[DONE]")
        finally:
            await handle.aclose()

    # ------------------------------------------------------------------ completions
    def completion_prompts(self, req: CompletionRequest) -> list[list[int]]:
        p = req.prompt
        if isinstance(p, str) or (p and isinstance(p[0], str)):
            tok = self.tok("prompt")
            try:
                return [tok.encode(s, add_special_tokens=req.add_special_tokens)
                        for s in ([p] if isinstance(p, str) else p)]
            except (TypeError, ValueError) as exc:  # e.g. a lone surrogate ("\ud800"): valid JSON, not valid Unicode
                raise ApiError(400, f"prompt: the tokenizer refused it ({exc}); send valid Unicode text or token ids") \
                    from None
        prompts = [p] if not p or isinstance(p[0], int) else p
        if any(not ids for ids in prompts):
            raise ApiError(400, "prompt: must not be empty")
        return prompts  # type: ignore[return-value]

    def completion_logprobs(self, ids: list[int], lps: list[float], tops: list | None,
                            as_ids: bool | None, offset: int = 0) -> dict[str, Any]:
        tokens = [self.token_str(t, as_ids) for t in ids]
        offsets = []
        for s in tokens:
            offsets.append(offset)
            offset += len(s)
        top = [{self.token_str(t, as_ids): lp for t, lp in pos} for pos in tops] if tops is not None else None
        return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": top, "text_offset": offsets}

    async def completions(self, req: CompletionRequest, request: Request) -> Any:
        refuse_unhonoured(req, chat=False)
        if req.echo:
            raise ApiError(400, "echo: not supported by this server")
        prompts = self.completion_prompts(req)
        top = req.logprobs or 0
        rid = "cmpl-" + new_id()
        if req.stream and (req.n != 1 or len(prompts) != 1):
            raise ApiError(400, "n: stream=true needs one prompt and n=1")
        handles: list[RequestHandle] = []
        try:
            for k, prompt in enumerate(prompts):
                handles += await self.submit_n(f"{rid}-{k}", prompt, req, req.max_tokens, top, "prompt")
        except BaseException:
            for h in handles:
                await h.aclose()
            raise
        if req.stream:
            return StreamingResponse(self.completion_stream(rid, handles[0], req, prompts[0]),
                                     media_type="text/event-stream")
        outs = await finish_all_or_disconnect(handles, request)
        if outs is None:
            return Response(status_code=499)
        choices = [{"index": i, "text": self.text(o.output_ids, req) if self.tokenizer is not None else "",
                    "logprobs": self.completion_logprobs(o.output_ids, o.output_logprobs, o.output_top_logprobs,
                                                         req.return_tokens_as_token_ids)
                    if req.logprobs is not None and self.tokenizer is not None else None,
                    "finish_reason": o.finish_reason, **self.extras(o)} for i, o in enumerate(outs)]
        prompt_tokens = sum(len(p) for p in prompts)
        body = {**self.base(rid, "text_completion"), "choices": choices,
                "usage": self.usage(prompt_tokens, outs)}
        body["prompt_token_ids"] = prompts[0] if len(prompts) == 1 else prompts
        return body

    async def completion_stream(self, rid: str, handle: RequestHandle, req: CompletionRequest,
                                prompt: list[int]) -> AsyncIterator[str]:
        base = self.base(rid, "text_completion")
        tok = self.tok("prompt")
        try:
            text, offset, done = _TextStream(tok, req), 0, 0
            async for d in handle:
                piece = text.push(d.new_token_ids, d.finished)
                done += len(d.new_token_ids)
                choice: dict[str, Any] = {"index": 0, "text": piece, "logprobs": None, "finish_reason": None,
                                          "token_ids": d.new_token_ids}
                if req.logprobs is not None and d.new_token_ids:
                    choice["logprobs"] = self.completion_logprobs(d.new_token_ids, d.new_logprobs,
                                                                  d.new_top_logprobs, req.return_tokens_as_token_ids,
                                                                  offset)
                offset += len(piece)
                if d.finished:
                    choice.update(finish_reason=d.output.finish_reason, meta_info=self.extras(d.output)["meta_info"])
                yield sse({**base, "choices": [choice], **self.stream_usage(req, len(prompt), done)})
                if d.finished and req.stream_options and req.stream_options.include_usage:
                    yield sse({**base, "choices": [], "usage": self.usage(len(prompt), [d.output])})
            yield sse("[DONE]")
        finally:
            await handle.aclose()

    def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": 0,
                                            "owned_by": "async_rl", "max_model_len": self.engine.max_context}]}


def _openai_names(message: str) -> str:
    """Engine/SamplingParams field names -> the names the OpenAI request used."""
    for ours, theirs in (("sampling_params.", ""), ("max_new_tokens", "max_tokens"), ("min_new_tokens", "min_tokens"),
                         ("no_stop_trim", "include_stop_str_in_output")):
        message = message.replace(ours, theirs)
    return message


def add_openai_routes(app: FastAPI, engine: AsyncEngine, *, tokenizer: Any, model_name: str) -> None:
    name = getattr(engine.engine.config, "tool_parser", "hermes")
    try:
        parser = build_tool_parser(name)
    except ValueError as exc:
        raise ValueError(str(exc).replace("agent.tool_parser", "engine.tool_parser")) from None
    h = _OpenAI(engine, tokenizer, model_name, parser)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatRequest, request: Request):
        return await h.chat(req, request)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        return await h.completions(req, request)

    @app.get("/v1/models")
    async def models():
        return h.models()
