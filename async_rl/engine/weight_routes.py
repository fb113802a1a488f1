"""SGLang's distributed weight-update routes on the embedded server (the `dist` transport).

    POST /init_weights_update_group       {"master_address", "master_port", "rank_offset", "world_size",
                                           "group_name", "backend"} (+ "timeout_s", ours)
    POST /update_weights_from_distributed {"names", "dtypes", "shapes", "group_name", "weight_version",
                                           "flush_cache", "abort_all_requests", "load_format", ...}
                                          (+ "bucket_bytes", "timeout_s", ours)
    POST /destroy_weights_update_group    {"group_name"}

An update runs only inside SGLang 0.5.23's session, `/begin_weight_update` ...
`/end_weight_update` (`weight_session.py`), else 400 as SGLang answers.

Field shapes follow SGLang's (see SGLANG.md); unknown SGLang fields are accepted and
ignored. `load_format=None` means SGLang's default, one broadcast per tensor in `names`
order; `"flattened_bucket"` means ours: the packed tensors cut into `bucket_bytes`
buckets (`weight_sync.layout`). Either way the version is staged in a file while
generation goes on, then swapped in at one step boundary (`update_weights_from_staged`):
a forward pass never mixes two versions, and on any error the old weights stay in use.
A group join or a transfer that does not finish within `timeout_s` fails with 400.
"""

from __future__ import annotations

import asyncio
import logging
import tempfile
from pathlib import Path
from typing import Literal

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, StrictInt

from async_rl.engine.async_engine import AsyncEngine
from async_rl.engine.http_common import ApiError, refuse_unflushable, version_label
from async_rl.engine.weight_session import WeightUpdateSession
from async_rl.types import WireFormatError
from async_rl.weight_sync.dist import DistWeightGroups
from async_rl.weight_sync.layout import WeightLayout
from async_rl.weight_sync.staging import WeightSyncError
from async_rl.weight_sync.versions import check_newer

logger = logging.getLogger(__name__)

DEFAULT_BUCKET_BYTES = 128 << 20


class _SGLangShaped(BaseModel):
    model_config = ConfigDict(extra="ignore")  # SGLang adds fields release by release


class InitGroupRequest(_SGLangShaped):
    master_address: str
    master_port: StrictInt
    rank_offset: StrictInt
    world_size: StrictInt
    group_name: str = "weight_update_group"
    backend: str = "nccl"
    timeout_s: float = 120.0


class UpdateDistributedRequest(_SGLangShaped):
    names: list[str]
    dtypes: list[str]
    shapes: list[list[StrictInt]]
    group_name: str = "weight_update_group"
    weight_version: str | None = None  # a string, as SGLang declares it (an int is refused: 400)
    flush_cache: bool = True  # refused under an in_place pause with requests running, as SGLang does
    abort_all_requests: bool = False
    load_format: Literal["flattened_bucket"] | None = None
    bucket_bytes: StrictInt = DEFAULT_BUCKET_BYTES


class DestroyGroupRequest(_SGLangShaped):
    group_name: str = "weight_update_group"


def weight_router(engine: AsyncEngine, session: WeightUpdateSession,
                  stage_dir: str | Path | None = None) -> APIRouter:
    """The routes, sharing one set of groups; versions are staged under `stage_dir` (a temp dir by default).
    An update runs only inside `session` (SGLang 0.5.23's /begin_weight_update ... /end_weight_update)."""
    router = APIRouter()
    device = engine.engine.runner.device
    groups = DistWeightGroups(stage_dir or tempfile.mkdtemp(prefix="async_rl_stage_"), device)
    lock = asyncio.Lock()  # one collective at a time per server

    @router.post("/init_weights_update_group")
    async def init_weights_update_group(req: InitGroupRequest):
        async with lock:
            try:
                await asyncio.to_thread(groups.init, req.master_address, req.master_port, req.rank_offset,
                                        req.world_size, req.group_name, req.backend, req.timeout_s)
            except WeightSyncError as exc:
                raise ApiError(400, str(exc)) from None
        return {"success": True, "message": f"joined group {req.group_name!r} as rank {req.rank_offset} of "
                                            f"{req.world_size}"}

    @router.post("/update_weights_from_distributed")
    async def update_weights_from_distributed(req: UpdateDistributedRequest):
        session.require("update_weights_from_distributed")
        await refuse_unflushable(engine, req.flush_cache)
        version = engine.weight_version + 1 if req.weight_version is None else version_label(req.weight_version)
        check_newer(version, engine.weight_version, field="weight_version", current_is="the version in use")
        try:
            layout = WeightLayout.from_specs(req.names, req.dtypes, req.shapes, version=version,
                                             bucket_bytes=req.bucket_bytes)
        except (ValueError, WireFormatError) as exc:
            raise ApiError(400, str(exc)) from None
        async with lock:
            aborted = await engine.abort_all() if req.abort_all_requests else 0
            try:
                path = await asyncio.to_thread(groups.receive, req.group_name, layout, req.load_format is None)
            except WeightSyncError as exc:
                raise ApiError(400, str(exc)) from None
        try:
            stats = await engine.update_weights_from_staged(str(path), version)
        except WeightSyncError as exc:
            raise ApiError(400, str(exc)) from None
        except ValueError as exc:  # names or shapes that are not this model's
            raise ApiError(400, f"names: {exc}") from None
        finally:
            path.unlink(missing_ok=True)
        return {"success": True, "message": f"loaded weight version {version} from group {req.group_name!r}",
                "weight_version": version, "num_paused_requests": int(stats.get("engine/interrupted", 0)),
                "num_aborted_requests": aborted, **stats}

    @router.post("/destroy_weights_update_group")
    async def destroy_weights_update_group(req: DestroyGroupRequest):
        found = groups.destroy(req.group_name)
        return {"success": found, "message": f"group {req.group_name!r} " + ("destroyed" if found else "not found")}

    return router
