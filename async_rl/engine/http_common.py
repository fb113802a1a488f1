"""The HTTP pieces every route module of the embedded server shares; it imports none of them.

    raise ApiError(400, "field: what is wrong")     # answered as {"error": {"message", "type", "code"}}
    install_error_handlers(app)                      # 400 for bad bodies, 503 for a stopped engine, 500 else
    app.add_middleware(StatusCounter, counts=refused)
    outs = await finish_all_or_disconnect(handles, request)   # None: the client left, requests aborted

`server.build_app` wires the routes (`generate_route`, `openai_api`, `weight_routes`,
`http_auth`); they all import from here, so no route module imports the app factory.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections import Counter
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict

from async_rl.engine.async_engine import AsyncEngine, EngineStoppedError, RequestHandle
from async_rl.engine.llm_engine import EngineInputError
from async_rl.engine.sglang_api import parse_version
from async_rl.types import GenerationOutput, SamplingParams
from async_rl.weight_sync.staging import WeightSyncError

logger = logging.getLogger(__name__)


class Strict(BaseModel):
    """A request body that refuses unknown fields (400 naming the field)."""

    model_config = ConfigDict(extra="forbid")


# --------------------------------------------------------------------------- errors
class ApiError(Exception):
    """An answer other than 200: status code and a message that names the field."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = headers


def error_response(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    """OpenAI's error shape, used by every route (the `openai` client reads `error.message`)."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    return JSONResponse(status_code=status, content={"error": {"message": message, "type": kind, "code": status}},
                        headers=headers)


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
        return error_response(exc.status, exc.message, exc.headers)

    @app.exception_handler(EngineInputError)
    async def _engine_input(request: Request, exc: EngineInputError) -> JSONResponse:
        return error_response(400, str(exc))

    @app.exception_handler(WeightSyncError)  # a version going backwards, a bad bucket: the old weights stay
    async def _weights_refused(request: Request, exc: WeightSyncError) -> JSONResponse:
        return error_response(400, str(exc))

    @app.exception_handler(EngineStoppedError)
    async def _stopped(request: Request, exc: EngineStoppedError) -> JSONResponse:
        return error_response(503, str(exc))

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        logger.error("%s %s failed", request.method, request.url.path, exc_info=exc)
        return error_response(500, f"internal error: {type(exc).__name__}: {exc}")


class StatusCounter:
    """ASGI middleware counting answers of status 400 and up, the router's 404/405 and 500s included:
    `engine/http_<status>_total` in /metrics shows how much bad input a server turned away."""

    def __init__(self, app: Any, counts: Counter[int]):
        self.app, self.counts = app, counts

    async def __call__(self, scope: dict[str, Any], receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def counted(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start" and message["status"] >= 400:
                self.counts[message["status"]] += 1
            await send(message)

        try:
            await self.app(scope, receive, counted)
        except Exception:  # answered with 500 by the outermost error handler
            self.counts[500] += 1
            raise


# --------------------------------------------------------------------------- helpers
async def _disconnected(request: Request) -> None:
    """Return when the client goes away (the body is already read, so only a disconnect arrives)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def finish_all_or_disconnect(handles: list[RequestHandle],
                                   request: Request) -> list[GenerationOutput] | None:
    """The finished outputs, or None (requests aborted) if the client disconnects first."""
    done_task = asyncio.ensure_future(asyncio.gather(*(h.wait() for h in handles)))
    # requests cancelled at shutdown or on disconnect end the gather with CancelledError: retrieve it,
    # so asyncio does not print "exception was never retrieved" tracebacks when a run ends
    done_task.add_done_callback(lambda f: f.cancelled() or f.exception())
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


def version_label(label: str) -> int:
    """SGLang's string `weight_version` as this engine's integer policy version; ApiError if it is not one."""
    version = parse_version(label)
    if version is None:
        raise ApiError(400, f"weight_version: must be an integer in a string (this engine numbers policy versions), "
                            f"got {label!r}")
    return version


async def refuse_unflushable(engine: AsyncEngine, flush_cache: bool) -> None:
    """ApiError when an update asks for `flush_cache` while paused requests still hold KV (a pause in mode
    in_place). SGLang refuses that flush and so fails the update, after loading the weights
    (scheduler_components/weight_updater.py, flush_cache_after_weight_update; scheduler.py, flush_cache:
    `is_fully_idle`); here it is refused before anything changes."""
    if flush_cache and engine.paused_by_request and await engine.running() > 0:
        raise ApiError(400, "flush_cache: requests paused in mode in_place hold KV, and the cache cannot be flushed "
                            "while they run (SGLang loads the weights, then fails the update); pause in mode retract "
                            "or send flush_cache: false")


def paused_requests(stats: dict[str, float]) -> int:
    """An update's requests in flight: those that recompute their KV and those that keep it."""
    return int(stats.get("engine/interrupted", 0) + stats.get("engine/kv_kept", 0))
