"""The embedded server's native /generate: SGLang's request fields in, SGLang's answer shapes out.

Accepted as SGLang accepts them: every `sampling_params` key of SGLang (`null` = unset;
see `SamplingParams.from_wire`), `max_new_tokens: 0` (prefill only: an empty answer, as
SGLang's frontend uses it), `n > 1` (n requests "<rid>_<i>", seeds seed + i, answered as
a list), `return_text_in_logprobs`, `return_prompt_token_ids`, `stream`, and SGLang's
bookkeeping fields (`log_metrics`, `priority`, `extra_key`, ...), which change nothing
here. Refused with 400 naming the field: what the engine cannot honour when it is set
(multimodal inputs, LoRA, custom logit processors, constrained decoding, prompt-token
log-probs via `logprob_start_len`), and unknown fields.

The answer's `text` is decoded with `skip_special_tokens`, and a matched stop string or
stop token is cut from it unless `no_stop_trim` (never from `output_ids`).
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from pydantic import StrictInt

from async_rl.engine.async_engine import AsyncEngine, RequestHandle
from async_rl.engine.llm_engine import EngineInputError
from async_rl.engine.http_common import ApiError, Strict, finish_all_or_disconnect, parse_sampling, sse
from async_rl.engine.sglang_api import incremental_chunk, meta_info
from async_rl.types import GenerationOutput, SamplingParams, new_id

# SGLang request fields asking for what the embedded engine cannot do: set -> 400 naming the field.
UNSUPPORTED_REQUEST = {
    "image_data": "image inputs", "video_data": "video inputs", "audio_data": "audio inputs",
    "input_embeds": "input embeddings", "lora_path": "LoRA adapters", "lora_id": "LoRA adapters",
    "custom_logit_processor": "custom logit processors", "token_ids_logprob": "log-probs of chosen token ids",
    "session_params": "sessions", "return_hidden_states": "hidden states", "return_routed_experts": "routed experts",
}


class GenerateRequest(Strict):
    input_ids: list[StrictInt] | None = None
    text: str | None = None  # tokenised by the server's tokenizer when input_ids is not given
    sampling_params: dict[str, Any] | None = None
    return_logprob: bool | None = None
    logprob_start_len: StrictInt | None = None  # -1 / null: output tokens only (prompt log-probs are not computed)
    top_logprobs_num: StrictInt | None = None  # same as sampling_params.top_logprobs
    return_text_in_logprobs: bool = False
    return_prompt_token_ids: bool = False
    rid: str | None = None
    stream: bool = False
    # SGLang's bookkeeping: accepted, no effect here
    log_metrics: bool = True
    priority: StrictInt | None = None
    extra_key: str | None = None
    routing_key: str | None = None
    no_logs: bool = False
    custom_labels: dict[str, str] | None = None
    modalities: list[str] | None = None
    cache_salt: str | None = None  # prefixes are never shared across salts: here the cache is dropped at every update
    # SGLang's, refused when set (UNSUPPORTED_REQUEST)
    image_data: Any = None
    video_data: Any = None
    audio_data: Any = None
    input_embeds: Any = None
    lora_path: Any = None
    lora_id: Any = None
    custom_logit_processor: Any = None
    token_ids_logprob: Any = None
    session_params: Any = None
    return_hidden_states: Any = None
    return_routed_experts: bool = False


def _cut_at_stop(text: str, stops: tuple[str, ...]) -> tuple[str, str | None]:
    hits = [(i, s) for s in stops if (i := text.find(s)) >= 0]
    if not hits:
        return text, None
    i, s = min(hits)
    return text[:i], s


class GenerateRoute:
    """Route body of /generate; `retracted` (shared with the pause route) counts retractions per request."""

    def __init__(self, engine: AsyncEngine, tokenizer: Any, retracted: Counter[str]):
        self.engine, self.tokenizer, self.retracted = engine, tokenizer, retracted

    # ------------------------------------------------------------------ request
    def params(self, req: GenerateRequest) -> tuple[SamplingParams, bool]:
        """The sampling params, and whether this is a prefill-only request (max_new_tokens 0)."""
        for name, what in UNSUPPORTED_REQUEST.items():
            value = getattr(req, name)
            if value is not None and value is not False and value != [] and value != "":
                raise ApiError(400, f"{name}: {what} are not supported by this server; leave it unset")
        wire = dict(req.sampling_params or {})
        prefill_only = wire.get("max_new_tokens") == 0
        if prefill_only:
            wire["max_new_tokens"] = 1
        if req.top_logprobs_num:
            wire["top_logprobs"] = req.top_logprobs_num
        return parse_sampling(wire), prefill_only

    def prompt_ids(self, req: GenerateRequest) -> list[int]:
        if (req.input_ids is None) == (req.text is None):
            raise ApiError(400, "input_ids: give exactly one of input_ids and text")
        if req.input_ids is not None:
            return req.input_ids
        if self.tokenizer is None:
            raise ApiError(400, "text: this server has no tokenizer; send input_ids")
        try:
            return self.tokenizer.encode(req.text)
        except (TypeError, ValueError) as exc:  # e.g. a lone surrogate ("\ud800"): valid JSON, not valid Unicode
            raise ApiError(400, f"text: the tokenizer refused it ({exc}); send valid Unicode text or input_ids") from None

    async def submit(self, rid: str, prompt: list[int], params: SamplingParams) -> list[RequestHandle]:
        n = params.n
        handles: list[RequestHandle] = []
        try:
            for i in range(n):
                p = params if n == 1 else dataclasses.replace(
                    params, n=1, seed=None if params.seed is None else params.seed + i)
                handles.append(await self.engine.submit(rid if n == 1 else f"{rid}_{i}", prompt, p))
        finally:
            if len(handles) < n:
                for h in handles:
                    await h.aclose()
        return handles

    async def generate(self, req: GenerateRequest, request: Request) -> Any:
        params, prefill_only = self.params(req)
        prompt = self.prompt_ids(req)
        if req.logprob_start_len not in (None, -1) and req.logprob_start_len < len(prompt):
            raise ApiError(400, "logprob_start_len: log-probs of prompt tokens are not computed by this server; "
                                "use -1 (output tokens only)")
        if req.stream and params.n > 1:
            raise ApiError(400, "sampling_params.n: n > 1 is not supported with stream: true; stream each sample")
        stream_interval(req)  # checked before anything is submitted
        rid = req.rid or new_id()
        if prefill_only:
            return self.prefill_only(rid, prompt, req)
        handles = await self.submit(rid, prompt, params)
        if req.stream:
            return StreamingResponse(self.stream(handles[0], req, params, prompt), media_type="text/event-stream")
        outs = await finish_all_or_disconnect(handles, request)
        if outs is None:
            for h in handles:
                self.retracted.pop(h.request_id, None)
            return Response(status_code=499)
        results = [self.result(o, req, params, prompt) for o in outs]
        return results[0] if params.n == 1 else results

    def prefill_only(self, rid: str, prompt: list[int], req: GenerateRequest) -> dict[str, Any]:
        """SGLang's max_new_tokens 0: nothing to sample; the prompt is checked like any other."""
        for i, t in enumerate(prompt):
            if not 0 <= t < self.engine.vocab_size:
                raise EngineInputError(f"input_ids[{i}]: token id {t!r} outside the vocabulary "
                                       f"(size {self.engine.vocab_size})")
        out = GenerationOutput(request_id=rid, prompt_len=len(prompt), output_ids=[], output_logprobs=[],
                               output_versions=[], finish_reason="length")
        return self.result(out, req, SamplingParams(), prompt)

    # ------------------------------------------------------------------ answer
    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def matched_stop_token(self, out: GenerationOutput, params: SamplingParams) -> int | None:
        if out.finish_reason != "stop" or not out.output_ids:
            return None
        last = out.output_ids[-1]
        stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.engine.engine.eos_token_ids))
        return last if last in stops else None

    def result(self, out: GenerationOutput, req: GenerateRequest, params: SamplingParams, prompt: list[int],
               finished: bool = True) -> dict[str, Any]:
        matched: int | str | None = self.matched_stop_token(out, params) if finished else None
        body: dict[str, Any] = {"output_ids": out.output_ids}
        if self.tokenizer is not None:
            ids = out.output_ids[:-1] if matched is not None and not params.no_stop_trim else out.output_ids
            text = self.tokenizer.decode(ids, skip_special_tokens=params.skip_special_tokens)
            if finished and out.finish_reason == "stop" and matched is None and params.stop:
                trimmed, matched = _cut_at_stop(text, params.stop)
                text = text if params.no_stop_trim else trimmed
            body["text"] = text
        retractions = self.retracted.pop(out.request_id, 0) if finished else self.retracted[out.request_id]
        body["meta_info"] = meta_info(
            out, bool(req.return_logprob), self.engine.weight_version, finished, retractions=retractions,
            token_text=self.token_text if req.return_text_in_logprobs and self.tokenizer is not None else None,
            matched=matched)
        if req.return_prompt_token_ids:
            body["prompt_token_ids"] = prompt
        return body

    async def stream(self, handle: RequestHandle, req: GenerateRequest, params: SamplingParams,
                     prompt: list[int]) -> AsyncIterator[str]:
        """SGLang's streaming shapes: every chunk carries the output so far, or with
        `engine.incremental_streaming_output` only what is new (`sglang_api.incremental_chunk`); then [DONE]."""
        incremental = getattr(self.engine.engine.config, "incremental_streaming_output", False)
        interval = stream_interval(req)
        sent = sent_text = 0
        streamed = 0  # output tokens the chunks so far covered
        try:
            async for delta in handle:
                unsent = len(handle.output_ids) - streamed
                # SGLang's cadence (output_streamer.py): every step at 1; else the first token at once, then
                # whenever `interval` tokens are unsent; the end always
                if not delta.finished and interval > 1 and not (unsent >= interval or (streamed == 0 and unsent)):
                    continue
                streamed = len(handle.output_ids)
                out = delta.output if delta.finished else GenerationOutput(
                    request_id=handle.request_id, prompt_len=handle.prompt_len, output_ids=handle.output_ids,
                    output_logprobs=handle.logprobs, output_versions=handle.versions, finish_reason="abort",
                    output_top_logprobs=handle.top)
                body = self.result(out, req, params, prompt, finished=delta.finished)
                if incremental:
                    body, sent, sent_text = (incremental_chunk(body, sent, sent_text), len(body["output_ids"]),
                                             len(body.get("text") or ""))
                yield sse(body)
            yield sse("[DONE]")
        finally:
            await handle.aclose()


def stream_interval(req: GenerateRequest) -> int:
    """`sampling_params.stream_interval` (SGLang's per-request chunk cadence, in tokens; null = 1), checked."""
    value = (req.sampling_params or {}).get("stream_interval")
    if value is None:
        return 1
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ApiError(400, f"sampling_params.stream_interval: must be a positive number of tokens, got {value!r}")
    return value


def add_generate_route(app: FastAPI, engine: AsyncEngine, tokenizer: Any, retracted: Counter[str]) -> None:
    route = GenerateRoute(engine, tokenizer, retracted)

    @app.api_route("/generate", methods=["POST", "PUT"])
    async def generate(req: GenerateRequest, request: Request):
        return await route.generate(req, request)
