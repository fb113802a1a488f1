"""HTTP server of the embedded engine: the subset of SGLang's native API that RL needs.

    POST /generate                 {"input_ids" | "text", "sampling_params", "return_logprob", "rid", "stream"}
    POST /pause_generation         {"mode": "in_place" (default) | "abort"}; in_place keeps requests in flight
    POST /continue_generation
    POST /update_weights_from_disk {"model_path", "weight_version"}: load, recompute KV, continue
    POST /abort_request            {"rid"} or {"abort_all": true}
    GET  /health, /get_model_info, /get_server_info, /metrics
    + the OpenAI-compatible routes of `openai_api` (/v1/chat/completions, /v1/completions, /v1/models)

Response shapes follow SGLang's; `meta_info` adds `output_token_versions` (the policy
version that sampled each token), `num_interruptions` and `weight_version`. Bad input is
answered with 400 and `{"error": {"message": "<field>: <what is wrong>", ...}}`; the
server keeps serving everyone else. A client that disconnects aborts its request.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, StrictInt

from async_rl.engine.async_engine import AsyncEngine, EngineStoppedError, RequestHandle
from async_rl.engine.llm_engine import EngineInputError
from async_rl.types import GenerationOutput, SamplingParams, new_id

logger = logging.getLogger(__name__)


# --------------------------------------------------------------------------- errors
class ApiError(Exception):
    """An answer other than 200: status code and a message that names the field."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


def error_response(status: int, message: str) -> JSONResponse:
    """OpenAI's error shape, used by every route (the `openai` client reads `error.message`)."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    return JSONResponse(status_code=status, content={"error": {"message": message, "type": kind, "code": status}})


def _location(loc: tuple) -> str:
    out = ""
    for part in loc[1:] if loc and loc[0] == "body" else loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "body"


def validation_message(exc: RequestValidationError) -> str:
    errors = exc.errors()
    if not errors:
        return "body: invalid request"
    first = errors[0]
    kind, where = first.get("type", ""), _location(tuple(first.get("loc", ())))
    if kind == "json_invalid":
        return f"body: malformed JSON ({first.get('ctx', {}).get('error', first.get('msg'))})"
    if kind == "extra_forbidden":
        return f"{where}: unknown field"
    if kind == "missing":
        return f"{where}: required" if where != "body" else "body: a JSON object is required"
    got = repr(first.get("input"))[:60]
    return f"{where}: {first.get('msg', 'invalid')} (got {got})"


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(400, validation_message(exc))

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return error_response(exc.status, exc.message)

    @app.exception_handler(EngineInputError)
    async def _engine_input(request: Request, exc: EngineInputError) -> JSONResponse:
        return error_response(400, str(exc))

    @app.exception_handler(EngineStoppedError)
    async def _stopped(request: Request, exc: EngineStoppedError) -> JSONResponse:
        return error_response(503, str(exc))

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        logger.error("%s %s failed", request.method, request.url.path, exc_info=exc)
        return error_response(500, f"internal error: {type(exc).__name__}: {exc}")


# --------------------------------------------------------------------------- shared helpers
async def _disconnected(request: Request) -> None:
    """Return when the client goes away (the body is already read, so only a disconnect arrives)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def finish_all_or_disconnect(handles: list[RequestHandle],
                                   request: Request) -> list[GenerationOutput] | None:
    """The finished outputs, or None (requests aborted) if the client disconnects first."""
    done_task = asyncio.ensure_future(asyncio.gather(*(h.wait() for h in handles)))
    gone_task = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({done_task, gone_task}, return_when=asyncio.FIRST_COMPLETED)
        return done_task.result() if done_task.done() else None
    finally:
        done_task.cancel()
        gone_task.cancel()
        for h in handles:
            await h.aclose()


def sse(payload: dict[str, Any] | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


def parse_sampling(d: dict[str, Any] | None) -> SamplingParams:
    try:
        return SamplingParams.from_wire(d)
    except (ValueError, TypeError) as exc:
        msg = str(exc)
        raise ApiError(400, msg if msg.startswith("sampling_params") else f"sampling_params: {msg}") from None


# --------------------------------------------------------------------------- native API
class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class GenerateRequest(_Strict):
    input_ids: list[StrictInt] | None = None
    text: str | None = None  # tokenised by the server's tokenizer when input_ids is not given
    sampling_params: dict[str, Any] | None = None
    return_logprob: bool = False
    top_logprobs_num: StrictInt = 0  # SGLang's name; same as sampling_params.top_logprobs
    rid: str | None = None
    stream: bool = False


class PauseRequest(_Strict):
    mode: Literal["in_place", "abort"] = "in_place"


class UpdateWeightsRequest(_Strict):
    model_path: str
    weight_version: StrictInt | None = None  # default: current version + 1
    load_format: Literal["safetensors"] | None = None
    abort_all_requests: bool = False


class AbortRequest(_Strict):
    rid: str = ""
    abort_all: bool = False


def meta_info(out: GenerationOutput, return_logprob: bool, weight_version: int,
              finished: bool = True) -> dict[str, Any]:
    reason: dict[str, Any] | None = None
    if finished:
        reason = {"type": out.finish_reason}
        if out.finish_reason == "length":
            reason["length"] = len(out.output_ids)
    meta: dict[str, Any] = {
        "id": out.request_id, "finish_reason": reason, "prompt_tokens": out.prompt_len,
        "completion_tokens": len(out.output_ids), "cached_tokens": out.prefix_cached_tokens,
        "output_token_versions": out.output_versions, "num_interruptions": out.num_interruptions,
        "weight_version": weight_version,
    }
    if return_logprob:
        meta["output_token_logprobs"] = [[lp, t] for lp, t in zip(out.output_logprobs, out.output_ids)]
        if out.output_top_logprobs is not None:
            meta["output_top_logprobs"] = [[[lp, t] for t, lp in pos] for pos in out.output_top_logprobs]
    return meta


class _App:
    """Route bodies of the native API, sharing the engine, tokenizer and model name."""

    def __init__(self, engine: AsyncEngine, tokenizer: Any, model_name: str):
        self.engine, self.tokenizer, self.model_name = engine, tokenizer, model_name

    def decode(self, ids: list[int]) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.decode(ids, skip_special_tokens=True)

    def prompt_ids(self, req: GenerateRequest) -> list[int]:
        if (req.input_ids is None) == (req.text is None):
            raise ApiError(400, "input_ids: give exactly one of input_ids and text")
        if req.input_ids is not None:
            return req.input_ids
        if self.tokenizer is None:
            raise ApiError(400, "text: this server has no tokenizer; send input_ids")
        return self.tokenizer.encode(req.text)

    def result(self, out: GenerationOutput, return_logprob: bool, finished: bool = True) -> dict[str, Any]:
        body: dict[str, Any] = {"output_ids": out.output_ids,
                                "meta_info": meta_info(out, return_logprob, self.engine.weight_version, finished)}
        text = self.decode(out.output_ids)
        if text is not None:
            body["text"] = text
        return body

    async def generate(self, req: GenerateRequest, request: Request) -> Any:
        params = parse_sampling(req.sampling_params)
        if req.top_logprobs_num:
            params = parse_sampling({**params.to_wire(), "top_logprobs": req.top_logprobs_num})
        handle = await self.engine.submit(req.rid or new_id(), self.prompt_ids(req), params)
        if req.stream:
            return StreamingResponse(self.stream(handle, req.return_logprob), media_type="text/event-stream")
        outs = await finish_all_or_disconnect([handle], request)
        return self.result(outs[0], req.return_logprob) if outs is not None else Response(status_code=499)

    async def stream(self, handle: RequestHandle, return_logprob: bool) -> AsyncIterator[str]:
        """SGLang's streaming shape: every chunk carries the output so far; then [DONE]."""
        try:
            async for delta in handle:
                out = delta.output if delta.finished else GenerationOutput(
                    request_id=handle.request_id, prompt_len=handle.prompt_len, output_ids=handle.output_ids,
                    output_logprobs=handle.logprobs, output_versions=handle.versions, finish_reason="abort")
                yield sse(self.result(out, return_logprob, finished=delta.finished))
            yield sse("[DONE]")
        finally:
            await handle.aclose()

    async def update_weights(self, req: UpdateWeightsRequest) -> dict[str, Any]:
        version = req.weight_version if req.weight_version is not None else self.engine.weight_version + 1
        aborted = await self.engine.abort_all() if req.abort_all_requests else 0
        try:
            stats = await self.engine.update_weights_from_disk(req.model_path, version)
        except FileNotFoundError as exc:
            raise ApiError(400, str(exc)) from None
        except EngineStoppedError:
            raise
        except Exception as exc:  # safetensors, shape and name errors all mean: this file does not fit
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ApiError(400, f"model_path: cannot load {req.model_path!r}: {first}") from None
        return {"success": True, "message": f"loaded weight version {version} from {req.model_path}",
                "weight_version": version, "num_paused_requests": int(stats.get("engine/interrupted", 0)),
                "num_aborted_requests": aborted, **stats}

    def model_info(self) -> dict[str, Any]:
        e = self.engine
        return {"model_path": self.model_name, "model_name": self.model_name, "tokenizer_path": self.model_name,
                "is_generation": True, "vocab_size": e.vocab_size, "max_context": e.max_context,
                "context_length": e.max_context, "max_new_tokens_limit": e.max_new_tokens_limit,
                "eos_token_ids": sorted(e.engine.eos_token_ids), "weight_version": e.weight_version}

    from async_rl.engine.weight_routes import weight_router  # likewise

def build_app(engine: AsyncEngine, *, model_name: str, tokenizer: Any = None) -> FastAPI:
    """The FastAPI app: native routes plus the OpenAI-compatible ones (these need `tokenizer`)."""
    from async_rl.engine.openai_api import add_openai_routes  # it imports this module's helpers

    app = FastAPI(title="async_rl embedded engine")
    install_error_handlers(app)
    h = _App(engine, tokenizer, model_name)

    @app.post("/generate")
    async def generate(req: GenerateRequest, request: Request):
        return await h.generate(req, request)

    @app.post("/pause_generation")
    async def pause_generation(req: PauseRequest | None = None):
        aborted = await engine.abort_all() if req is not None and req.mode == "abort" else 0
        await engine.pause()
        return {"success": True, "message": "generation paused", "num_aborted_requests": aborted}

    @app.post("/continue_generation")
    async def continue_generation():
        await engine.resume()
        return {"success": True, "message": "generation continued"}

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(req: UpdateWeightsRequest):
        return await h.update_weights(req)

    @app.post("/abort_request")
    async def abort_request(req: AbortRequest):
        if req.abort_all:
            return {"success": True, "num_aborted_requests": await engine.abort_all()}
        if not req.rid:
            raise ApiError(400, "rid: required (or abort_all: true)")
        return {"success": await engine.abort(req.rid)}

    @app.get("/health")
    async def health():
        if not engine.alive:
            return error_response(503, "engine loop is not running")
        return {"status": "ok", "paused": engine.paused, "weight_version": engine.weight_version}

    @app.get("/get_model_info")
    async def get_model_info():
        return h.model_info()

    @app.get("/get_server_info")
    async def get_server_info():
        cfg = engine.engine.config
        return {**h.model_info(), "engine_config": {k: getattr(cfg, k) for k in cfg.__dataclass_fields__},
                "stats": engine.stats()}

    @app.get("/metrics")
    async def metrics():
        return engine.stats()

    add_openai_routes(app, engine, tokenizer=tokenizer, model_name=model_name)
    return app
    app.include_router(weight_router(engine))  # SGLang's distributed weight-update routes
