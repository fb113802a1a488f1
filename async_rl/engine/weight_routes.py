"""SGLang's distributed weight-update routes on the embedded server (the `dist` transport).

    POST /init_weights_update_group       {"master_address", "master_port", "rank_offset", "world_size",
                                           "group_name", "backend"} (+ "timeout_s", ours)
    POST /update_weights_from_distributed {"names", "dtypes", "shapes", "group_name", "weight_version",
                                           "flush_cache", "abort_all_requests", "load_format", ...}
    POST /destroy_weights_update_group    {"group_name"}

Field shapes follow SGLang's (`srt/managers/io_struct.py`); unknown SGLang fields are
accepted and ignored. An update runs only inside SGLang 0.5.23's session,
`/begin_weight_update` ... `/end_weight_update` (`weight_session.py`), else 400 as SGLang
answers. One update request receives exactly what SGLang receives for it
(`weight_sync.dist_server`): `load_format="flattened_bucket"` is ONE broadcast of every
tensor the request names, `None` one broadcast per named tensor. A model arrives in one
request or in several (one per bucket, in one session); each request's tensors go straight
into the parameters on the engine's device, with the engine loop held at a step boundary
from the first part of a version until it is complete (`AsyncEngine.load_tensors`): the
request that carries `weight_version` (a string, as SGLang declares it), or, without one,
the request after which every parameter has arrived. So a forward pass never mixes two
versions. A transfer that fails leaves the parameters partly updated (as SGLang does) and
the loop paused until a whole version loads; the rollout side fences such a server. An
update asking to flush the cache under an in_place pause with requests running is refused,
as SGLang fails it. A group join or a transfer that does not finish within the group's
`timeout_s` fails with 400.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Literal

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, StrictInt

from async_rl.engine.async_engine import AsyncEngine
from async_rl.engine.http_common import ApiError, paused_requests, refuse_unflushable, version_label
from async_rl.engine.weight_session import WeightUpdateSession
from async_rl.weight_sync.dist_server import DistWeightGroups
from async_rl.weight_sync.layout import dtype_name
from async_rl.weight_sync.staging import WeightSyncError
from async_rl.weight_sync.versions import check_newer

logger = logging.getLogger(__name__)

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


class DestroyGroupRequest(_SGLangShaped):
    group_name: str = "weight_update_group"


def weight_router(engine: AsyncEngine, session: WeightUpdateSession) -> APIRouter:
    """The routes, sharing one set of groups; tensors are received on the engine's device. An update
    runs only inside `session` (SGLang 0.5.23's /begin_weight_update ... /end_weight_update)."""
    router = APIRouter()
    groups = DistWeightGroups(engine.engine.runner.device)
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
        version = None if req.weight_version is None else version_label(req.weight_version)
        if version is not None:
            check_newer(version, engine.weight_version, field="weight_version", current_is="the version in use")
        try:
            if not (len(req.names) == len(req.dtypes) == len(req.shapes)):
                raise ValueError(f"names, dtypes, shapes: must have the same length, got "
                                 f"{len(req.names)}, {len(req.dtypes)}, {len(req.shapes)}")
            dtypes = [dtype_name(d, f"dtypes[{i}]") for i, d in enumerate(req.dtypes)]
        except ValueError as exc:
            raise ApiError(400, str(exc)) from None
        async with lock:
            aborted = await engine.abort_all() if req.abort_all_requests else 0
            try:
                tensors = await asyncio.to_thread(groups.receive, req.group_name, req.names, dtypes, req.shapes,
                                                  req.load_format)
                stats = await engine.load_tensors(tensors, version)
            except WeightSyncError as exc:
                raise ApiError(400, str(exc)) from None
            except ValueError as exc:  # names or shapes that are not this model's, an unaligned bucket
                raise ApiError(400, f"names: {exc}") from None
        done = engine.weight_version if stats.get("engine/weights_complete") else None
        return {"success": True, "message": f"loaded {len(tensors)} tensors from group {req.group_name!r}" +
                (f"; weight version {done} in use" if done is not None else ""),
                "weight_version": done, "num_paused_requests": paused_requests(stats),
                "num_aborted_requests": aborted, **stats}

    @router.post("/destroy_weights_update_group")
    async def destroy_weights_update_group(req: DestroyGroupRequest):
        found = await asyncio.to_thread(groups.destroy, req.group_name)
        return {"success": found, "message": f"group {req.group_name!r} " + ("destroyed" if found else "not found")}

    return router
