"""HTTP server of the embedded engine: SGLang's native API as RL uses it, so SGLang's clients drive it too.

    POST|PUT /generate             {"input_ids" | "text", "sampling_params", "return_logprob", "top_logprobs_num",
                                    "rid", "stream", ...}; sampling_params.n > 1 answers a list (rids "<rid>_<i>")
    POST /pause_generation         {"mode": "abort" | "retract" (our default) | "in_place"}
    POST /continue_generation
    POST /update_weights_from_disk {"model_path" (a directory, as SGLang takes it), "weight_version"}: swap in
                                   from a memory map at a step boundary, recompute KV, continue (a version
                                   not newer is refused); /model_info reports that path afterwards, as SGLang
    GET|POST /flush_cache          drop the prefix cache (400 while requests are running)
    POST /abort_request            {"rid"} (every request whose rid starts with it, as SGLang) or {"abort_all": true}
    GET  /health, /health_generate (as SGLang's: no answer while generation is paused, 503 after 20 s),
         /model_info (answers while paused; /get_model_info, deprecated), /server_info, /get_server_info, /metrics
    + the OpenAI-compatible routes of `openai_api`, the weight-transfer routes of `weight_routes` and
      SGLang 0.5.23's /begin_weight_update and /end_weight_update around them (`weight_session`)

Pause modes, as SGLang defines them: `abort` returns every running and waiting request at
once with its partial output (finish_reason abort); `retract` frees the KV of the requests
in flight, which keep their tokens and recompute it when generation continues; `in_place`
stops stepping and keeps the KV. New requests wait while paused. A weight update under an
`in_place` pause keeps that KV, as SGLang does: the requests go on over keys and values the
old weights computed (no recompute; `rollout.pause_mode=in_place`). Under the other modes, or
unpaused, the requests in flight recompute their KV under the new weights. SGLang's default
mode is `abort`; ours is `retract`, so a bare pause never loses work: clients should name the mode.

Answers follow SGLang's shapes (`sglang_api`): finish_reason objects, log-probs as
[logprob, token_id, text], `weight_version`, `weight_versions` spans and `num_retractions`;
`meta_info` adds `output_token_versions` (the policy version that sampled each token)
and `num_interruptions`. Bad input is answered with 400 and
`{"error": {"message": "<field>: <what is wrong>", ...}}`; the server keeps serving
everyone else, and /metrics counts every answer of 400 and up (`engine/http_<status>_total`).
A client that disconnects aborts its request.

With `engine.api_key` set, every route but /health(_generate) and /get_model_info (/model_info)
answers 401 without `Authorization: Bearer <token>` (`http_auth`: one dependency on the app).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from pathlib import Path
from typing import Any, Literal

from fastapi import Depends, FastAPI
from fastapi.responses import Response
from pydantic import StrictInt

from async_rl.config import REDACTED, resolve_secret
from async_rl.engine.async_engine import AsyncEngine, EngineStoppedError
from async_rl.engine.generate_route import add_generate_route
from async_rl.engine.http_auth import BearerGuard
from async_rl.engine.http_common import (ApiError, StatusCounter, Strict, error_response, install_error_handlers,
                                         paused_requests, refuse_unflushable, version_label)
from async_rl.engine.openai_api import add_openai_routes
from async_rl.engine.weight_routes import weight_router
from async_rl.engine.weight_session import WeightUpdateSession
from async_rl.weight_sync.staging import WeightVersionError
from async_rl.weight_sync.versions import check_newer

logger = logging.getLogger(__name__)

HEALTH_CHECK_TIMEOUT_S = 20.0  # SGLang's HEALTH_CHECK_TIMEOUT (srt/entrypoints/http_server.py)


# --------------------------------------------------------------------------- native API
class PauseRequest(Strict):
    # SGLang's default is "abort"; ours keeps requests in flight (the RL-safe one). Clients name the mode.
    mode: Literal["abort", "retract", "in_place"] = "retract"


class ContinueRequest(Strict):
    torch_empty_cache: bool = True  # SGLang's; nothing to empty here


class UpdateWeightsRequest(Strict):
    model_path: str
    # default: current version + 1. A string, as SGLang declares it (io_struct.UpdateWeightFromDiskReqInput:
    # Optional[str]); pydantic does not turn an int into one, so an int is refused there and here
    weight_version: str | None = None
    load_format: Literal["safetensors", "auto"] | None = None
    abort_all_requests: bool = False
    # refused while requests paused in_place hold KV, as SGLang does (they keep that KV across the update)
    flush_cache: bool = True
    is_async: bool = False  # SGLang's scheduling knobs: no effect here
    torch_empty_cache: bool = False
    keep_pause: bool = False  # an update never changes whether generation is paused here
    recapture_cuda_graph: bool = False
    token_step: StrictInt = 0
    manifest: None = None


class AbortRequest(Strict):
    rid: str = ""
    abort_all: bool = False


def weights_directory(model_path: str) -> str:
    """`model_path` if it is a directory; ApiError otherwise. SGLang loads a local checkpoint only from a
    directory (every *.safetensors in it; sglang/srt/model_loader/loader.py, `os.path.isdir`) and sends any
    other path to the Hugging Face hub, so a file path never loads there and is refused here too."""
    p = Path(model_path)
    if p.is_dir():
        return model_path
    if p.exists():
        raise ApiError(400, f"model_path: {model_path!r} is a file; give the directory that holds it (SGLang loads "
                            "every *.safetensors of a checkpoint directory and looks any other path up on the hub)")
    raise ApiError(400, f"model_path: {model_path!r} does not exist (pruned by weight_sync.keep_last, or never "
                        "written?)")


class _Control:
    """Pause modes, weight updates and cache control; `retracted` counts retractions per request id;
    `model_path` is what the server serves: after an update from disk, that path (as SGLang reports it)."""

    def __init__(self, engine: AsyncEngine, model_path: str):
        self.engine = engine
        self.model_path = model_path
        self.retracted: Counter[str] = Counter()

    async def pause(self, mode: str) -> dict[str, Any]:
        # first: nothing steps (or starts) while requests are aborted or retracted
        await self.engine.pause(keep_kv=mode == "in_place")
        aborted = await self.engine.abort_all() if mode == "abort" else 0
        retracted = await self.engine.retract_all() if mode == "retract" else []
        self.retracted.update(retracted)
        return {"message": "Generation paused successfully.", "status": "ok", "success": True, "mode": mode,
                "num_aborted_requests": aborted, "num_retracted_requests": len(retracted)}

    async def update_weights(self, req: UpdateWeightsRequest) -> dict[str, Any]:
        version = self.engine.weight_version + 1
        if req.weight_version is not None:
            version = version_label(req.weight_version)
        # checked again at the swap; here so nothing is aborted
        check_newer(version, self.engine.weight_version, field="weight_version", current_is="the version in use")
        weights_directory(req.model_path)
        await refuse_unflushable(self.engine, req.flush_cache)
        aborted = await self.engine.abort_all() if req.abort_all_requests else 0
        try:  # memory-mapped: each tensor is copied once into the model; names and shapes checked first
            stats = await self.engine.update_weights_from_staged(req.model_path, version)
        except FileNotFoundError as exc:
            raise ApiError(400, str(exc)) from None
        except WeightVersionError as exc:
            raise ApiError(400, str(exc)) from None
        except EngineStoppedError:
            raise
        except Exception as exc:  # safetensors, shape and name errors all mean: this file does not fit
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ApiError(400, f"model_path: cannot load {req.model_path!r}: {first}") from None
        self.model_path = req.model_path  # SGLang's /model_info reports the weights' path from now on
        return {"success": True, "message": f"loaded weight version {version} from {req.model_path}",
                "weight_version": version, "num_paused_requests": paused_requests(stats),
                "num_aborted_requests": aborted, **stats}

    async def flush_cache(self) -> Response:
        if await self.engine.flush_cache():
            return Response("Cache flushed.\n", status_code=200)
        return Response("Cache not flushed: requests are running (pause with mode retract, or abort them).\n",
                        status_code=400)


def model_info(engine: AsyncEngine, model_path: str, tokenizer_path: str) -> dict[str, Any]:
    """SGLang's /model_info keys (`model_path` and `served_model_name` follow an update from disk), plus
    the engine's limits."""
    return {"model_path": model_path, "served_model_name": model_path,
            "tokenizer_path": tokenizer_path, "is_generation": True, "vocab_size": engine.vocab_size,
            "max_context": engine.max_context, "context_length": engine.max_context,
            "max_new_tokens_limit": engine.max_new_tokens_limit,
            "eos_token_ids": sorted(engine.engine.eos_token_ids), "weight_version": engine.weight_version}


def build_app(engine: AsyncEngine, *, model_name: str, tokenizer: Any = None, api_key: str | None = None) -> FastAPI:
    """The FastAPI app: native routes plus the OpenAI-compatible ones (these need `tokenizer`).
    `api_key` (default: the engine's `engine.api_key`; "env:NAME" is read from the environment)
    guards every route but the health and model-info probes; "" = open."""
    token = resolve_secret(getattr(engine.engine.config, "api_key", "") if api_key is None else api_key,
                           "engine.api_key")
    guard = BearerGuard(token) if token else None
    closed = {"dependencies": [Depends(guard)], "openapi_url": None, "docs_url": None, "redoc_url": None}
    app = FastAPI(title="async_rl embedded engine", **(closed if guard else {}))  # guarded: no open schema pages
    install_error_handlers(app)
    refused: Counter[int] = Counter()  # answers by status >= 400
    app.add_middleware(StatusCounter, counts=refused)
    control = _Control(engine, model_name)
    add_generate_route(app, engine, tokenizer, control.retracted)

    @app.post("/pause_generation")
    async def pause_generation(req: PauseRequest | None = None):
        return await control.pause((req or PauseRequest()).mode)

    @app.post("/continue_generation")
    async def continue_generation(req: ContinueRequest | None = None):
        await engine.resume()
        return {"message": "Generation continued successfully.", "status": "ok", "success": True}

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(req: UpdateWeightsRequest):
        return await control.update_weights(req)

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache():
        return await control.flush_cache()

    @app.post("/abort_request")
    async def abort_request(req: AbortRequest):
        if req.abort_all:
            return {"success": True, "num_aborted_requests": await engine.abort_all()}
        if not req.rid:
            raise ApiError(400, "rid: required (or abort_all: true)")
        # SGLang aborts every request whose rid starts with this one (scheduler.py, abort_request)
        return {"success": await engine.abort_prefix(req.rid) > 0}

    @app.get("/health")
    @app.get("/health_generate")
    async def health():
        # SGLang's /health runs a one-token generation (SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION, on by default),
        # which waits while generation is paused: no answer until it continues, 503 after HEALTH_CHECK_TIMEOUT
        deadline = time.monotonic() + HEALTH_CHECK_TIMEOUT_S
        while engine.alive and engine.paused and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if not engine.alive:
            return error_response(503, "engine loop is not running")
        if engine.paused:
            return error_response(503, f"generation paused for more than {HEALTH_CHECK_TIMEOUT_S:g}s: the health "
                                       "check generates a token, as SGLang's does")
        return {"status": "ok", "paused": engine.paused, "weight_version": engine.weight_version}

    @app.get("/get_model_info")
    @app.get("/model_info")
    async def get_model_info():
        return model_info(engine, control.model_path, model_name)

    @app.get("/get_server_info")
    @app.get("/server_info")
    async def get_server_info():
        cfg = engine.engine.config
        shown = {k: getattr(cfg, k) for k in cfg.__dataclass_fields__}
        if shown.get("api_key"):
            shown["api_key"] = REDACTED
        return {**model_info(engine, control.model_path, model_name), "engine_config": shown, "stats": engine.stats()}

    @app.get("/metrics")
    async def metrics():
        return {**engine.stats(), **(guard.stats() if guard else {}),
                **{f"engine/http_{status}_total": n for status, n in sorted(refused.items())}}

    add_openai_routes(app, engine, tokenizer=tokenizer, model_name=model_name)
    session = WeightUpdateSession()  # SGLang 0.5.23's /begin_weight_update ... /end_weight_update
    app.include_router(session.router())
    app.include_router(weight_router(engine, session))  # SGLang's distributed weight-update routes
    return app
