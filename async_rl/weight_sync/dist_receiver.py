"""The `dist` transport, rollout side: puts every server in the trainer's group and drives SGLang's routes.

Per version, on each server (concurrently, each under `weight_sync.deadline_s`):

    POST /init_weights_update_group        once per group: master_address, master_port, rank_offset,
                                           world_size, group_name, backend
    POST /begin_weight_update              SGLang 0.5.23 refuses distributed updates outside this session
    POST /update_weights_from_distributed  one per bucket: that bucket's names, dtypes, shapes,
                                           load_format "flattened_bucket"; the last one carries
                                           weight_version (a string) and flush_cache
    POST /end_weight_update                always, once begun (a failed update must not leave it open)

Ranks: the trainer is rank 0; servers get `rank_offset`s in the order this side first sees
them, each taking as many ranks as it has tensor-parallel ranks (`/server_info` tp_size;
SGLang puts TP rank t at `rank_offset + t`). A server that fails leaves the group (it joins
the next one the trainer forms after the failure).
"""

from __future__ import annotations

import logging
from typing import Any

from async_rl.protocols import GenerationClient
from async_rl.utils.logs import one_line
from async_rl.weight_sync.staging import WeightSyncError
from async_rl.weight_sync.versions import check_newer

logger = logging.getLogger(__name__)

WILDCARDS = ("", "*", "0.0.0.0", "::", "[::]")


def host_of(addr: str) -> str:
    """The host of a `tcp://HOST:PORT` address ("" when there is none)."""
    if not addr.startswith("tcp://"):
        return ""
    return addr[len("tcp://"):].rsplit(":", 1)[0].strip("[]")


class DistWeightReceiver:
    """Ranks servers after the trainer (rank 0) and drives SGLang's distributed-update routes on each.
    `trainer_host`: the host this side reaches the trainer's queue at, used when the trainer is bound to
    a wildcard address and cannot name itself."""

    def __init__(self, deadline_s: float, trainer_host: str = ""):
        self.deadline_s = deadline_s
        self.trainer_host = "" if trainer_host in WILDCARDS else trainer_host
        self.accepted = -1
        self._ranks: dict[str, tuple[int, int]] = {}  # server address -> (rank_offset, tp_size)
        self._joined: dict[str, str] = {}  # server address -> group name it joined

    async def prepare(self, msg: dict[str, Any]) -> dict[str, Any]:
        version = int(msg["version"])
        check_newer(version, self.accepted, field="weights.version", current_is="the version already accepted")
        group = msg.get("group")
        if not isinstance(group, dict) or not {"master_address", "master_port", "world_size", "group_name"} <= set(group):
            raise WeightSyncError("weights.group: missing or incomplete (the trainer and this side disagree on "
                                  "weight_sync.transport?)")
        if not isinstance(msg.get("buckets"), list):
            raise WeightSyncError("weights.buckets: missing (a trainer from before flattened buckets per request?)")
        self.accepted = version
        address = group["master_address"]
        if address in WILDCARDS:
            address = self.trainer_host or "127.0.0.1"
        return {**msg, "group": {**group, "master_address": address}}

    async def _rank_offset(self, client: GenerationClient, world_size: int) -> int:
        if client.address not in self._ranks:
            tp = int(await client.tp_size()) if hasattr(client, "tp_size") else 1
            first = 1 + sum(tp for _, tp in self._ranks.values())
            self._ranks[client.address] = (first, tp)
        first, tp = self._ranks[client.address]
        if first + tp > world_size:
            raise WeightSyncError(f"{client.address}: its ranks {first}..{first + tp - 1} do not fit the trainer's "
                                  f"group of world_size {world_size} (set rollout.num_servers / rollout.server_addrs "
                                  "and engine.tp_size the same on both sides)")
        return first

    async def load(self, client: GenerationClient, prepared: dict[str, Any], version: int) -> None:
        group = prepared["group"]
        name = group["group_name"]
        rank = await self._rank_offset(client, group["world_size"])
        try:
            if self._joined.get(client.address) != name:
                if client.address in self._joined:  # an older group, torn down after a failure
                    await client.destroy_weights_update_group(self._joined.pop(client.address))
                await client.init_weights_update_group(group["master_address"], group["master_port"], rank,
                                                       group["world_size"], name, group.get("backend", "gloo"),
                                                       timeout_s=self.deadline_s)
                self._joined[client.address] = name
            await self._send_buckets(client, prepared, version)
        except Exception:
            self._joined.pop(client.address, None)  # it rejoins the next group
            raise

    async def _send_buckets(self, client: GenerationClient, prepared: dict[str, Any], version: int) -> None:
        names, dtypes, shapes, buckets = (prepared[k] for k in ("names", "dtypes", "shapes", "buckets"))
        await client.begin_weight_update()
        try:
            for index, (a, b) in enumerate(buckets):
                last = index == len(buckets) - 1
                await client.update_weights_from_distributed(
                    names[a:b], dtypes[a:b], shapes[a:b], prepared["group"]["group_name"],
                    version if last else None, load_format="flattened_bucket", flush_cache=last,
                    timeout_s=self.deadline_s)
        finally:
            try:
                await client.end_weight_update()
            except Exception as exc:  # the update's own error (if any) is the one to report
                logger.warning("%s: /end_weight_update failed: %s", client.address, one_line(exc))

    async def release(self, prepared: dict[str, Any]) -> None:
        return None

    def superseded(self, prepared: dict[str, Any], version: int) -> bool:
        return False  # a broadcast leaves nothing to prune
