"""The `dist` weight transport: a torch.distributed group between the trainer and every server.

How the group forms. The trainer (rank 0) is the master: at its first publish it opens a
TCPStore on a free port of `host` and announces the group in the version's "weights"
CONTROL message (`master_address`, `master_port`, `world_size`, `group_name`, `backend`),
then waits for the ranks to join. The rollout side assigns ranks 1..N to its servers in
the order it first sees them and posts SGLang's `/init_weights_update_group` to each, then
`/update_weights_from_distributed` (names, dtypes, shapes, group_name, weight_version,
load_format="flattened_bucket", bucket_bytes). The trainer learns N from the config
(`len(rollout.server_addrs)`, else `rollout.num_servers`): the group needs every server.

The data. The trainer broadcasts the version's data section (`layout.WeightLayout`) in
buckets of `bucket_bytes` (one uint8 tensor each); every server writes each bucket into a
staged file (`staging.StagedFile`) and, once all arrived, swaps the whole version in at a
step boundary. With `load_format=None` (SGLang's own meaning) each tensor is broadcast on
its own, in `names` order, which a trainer written for SGLang does.

Deadlines. The store and every collective time out after `weight_sync.deadline_s`, so a
missing or dead server fails the update with an error naming that key; nothing hangs.
A failed update tears the group down on both sides (the weights in use do not change);
the next publish forms a fresh group under a new `group_name`, which the rollout side
joins again with every server it still has, so a server that was fenced and comes back
under the same address rejoins then. A rank the trainer did not plan for (more servers
than `world_size - 1`) is refused with a clear error.

Groups are built from a TCPStore and a backend class directly (not the global default
group), so one process may hold several (the tests run two servers in one process).
"""

from __future__ import annotations

import datetime
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from async_rl.protocols import GenerationClient
from async_rl.weight_sync.layout import DTYPES, WeightLayout, byte_view
from async_rl.weight_sync.staging import StagedFile, WeightSyncError
from async_rl.weight_sync.versions import check_newer

logger = logging.getLogger(__name__)


def _gloo(store: Any, rank: int, world_size: int, timeout: datetime.timedelta) -> Any:
    return dist.ProcessGroupGloo(store, rank, world_size, timeout)


def _nccl(store: Any, rank: int, world_size: int, timeout: datetime.timedelta) -> Any:
    if not hasattr(dist, "ProcessGroupNCCL") or not torch.cuda.is_available():
        raise WeightSyncError("backend: nccl needs CUDA and a torch built with NCCL; use gloo on CPU")
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = timeout
    return dist.ProcessGroupNCCL(store, rank, world_size, opts)


BACKENDS: dict[str, Callable[..., Any]] = {"gloo": _gloo, "nccl": _nccl}


def open_group(backend: str, store: Any, group_name: str, rank: int, world_size: int, timeout_s: float) -> Any:
    """A process group over `store` (blocks until all `world_size` ranks joined or `timeout_s` passed)."""
    if backend not in BACKENDS:
        raise WeightSyncError(f"backend: {backend!r} is not supported (allowed: {', '.join(BACKENDS)})")
    if not 0 <= rank < world_size:
        raise WeightSyncError(f"rank_offset: rank {rank} does not fit world_size {world_size}")
    timeout = datetime.timedelta(seconds=timeout_s)
    try:
        return BACKENDS[backend](dist.PrefixStore(group_name, store), rank, world_size, timeout)
    except RuntimeError as exc:
        raise WeightSyncError(f"group {group_name!r}: rank {rank} of {world_size} could not join within "
                              f"weight_sync.deadline_s={timeout_s:g}s ({str(exc).splitlines()[0][:200]})") from None


def _broadcast(group: Any, tensor: torch.Tensor, what: str, timeout_s: float) -> None:
    try:
        group.broadcast(tensor, 0).wait()
    except RuntimeError as exc:
        raise WeightSyncError(f"{what}: broadcast failed or timed out (weight_sync.deadline_s={timeout_s:g}s): "
                              f"{str(exc).splitlines()[0][:200]}") from None


# --------------------------------------------------------------------------- trainer side
class DistWeightPublisher:
    """Rank 0. `send(control)` broadcasts a CONTROL map to the rollout side (the trajectory queue)."""

    def __init__(self, send: Callable[[dict[str, Any]], Any], num_servers: int, bucket_bytes: int,
                 deadline_s: float, host: str = "127.0.0.1", backend: str = "gloo", device: str = "cpu"):
        if num_servers < 1:
            raise ValueError(f"rollout.num_servers: the dist transport needs at least one server, got {num_servers}")
        if backend not in BACKENDS:
            raise ValueError(f"weight_sync backend: {backend!r} is not supported (allowed: {', '.join(BACKENDS)})")
        self.send, self.world_size = send, num_servers + 1
        self.bucket_bytes, self.deadline_s = int(bucket_bytes), deadline_s
        self.host, self.backend, self.device = host, backend, torch.device(device)
        self.last_version = -1
        self.generation = 0
        self._store: Any = None
        self._group: Any = None
        self.stats: dict[str, float] = {}

    def publish(self, state_dict: dict[str, Any], version: int) -> None:
        """Announce `version` over the queue, then broadcast it; returns None (the message already went)."""
        if isinstance(version, int):
            check_newer(version, self.last_version, field="version", current_is="the last published")
        t0 = time.perf_counter()
        layout, tensors = WeightLayout.from_state_dict(state_dict, version=version, bucket_bytes=self.bucket_bytes)
        if self._store is None:
            self.generation += 1
            self._store = dist.TCPStore(self.host, 0, self.world_size, True,
                                        datetime.timedelta(seconds=self.deadline_s), wait_for_workers=False)
        info = {"master_address": self.host, "master_port": self._store.port, "world_size": self.world_size,
                "group_name": f"async_rl_weights_{self.generation}", "backend": self.backend}
        self.send({"kind": "weights", "version": version, "transport": "dist", "group": info,
                   "bucket_bytes": self.bucket_bytes, **layout.specs()})
        try:
            if self._group is None:
                self._group = open_group(self.backend, self._store, info["group_name"], 0, self.world_size,
                                         self.deadline_s)
            for index, (start, end) in enumerate(layout.buckets):
                bucket = torch.empty(end - start, dtype=torch.uint8, device=self.device)
                at = 0
                for part in layout.read(tensors, start, end):
                    bucket[at:at + part.size].copy_(torch.from_numpy(part))
                    at += part.size
                _broadcast(self._group, bucket, f"weights v{version} bucket {index}", self.deadline_s)
                del bucket
        except WeightSyncError:
            self.close()  # a fresh group (new name) forms at the next publish
            raise
        self.last_version = version
        self.stats = {"sync/publish_s": time.perf_counter() - t0, "sync/bytes": float(layout.data_len),
                      "sync/buckets": float(len(layout.buckets))}
        return None

    def close(self) -> None:
        self._group = None
        self._store = None


# --------------------------------------------------------------------------- rollout side
class DistWeightReceiver:
    """Ranks servers 1..N and drives SGLang's distributed-update routes on each."""

    def __init__(self, deadline_s: float):
        self.deadline_s = deadline_s
        self.accepted = -1
        self._ranks: dict[str, int] = {}  # server address -> rank
        self._joined: dict[str, str] = {}  # server address -> group name it joined

    async def prepare(self, msg: dict[str, Any]) -> dict[str, Any]:
        version = int(msg["version"])
        check_newer(version, self.accepted, field="weights.version", current_is="the version already accepted")
        group = msg.get("group")
        if not isinstance(group, dict) or not {"master_address", "master_port", "world_size", "group_name"} <= set(group):
            raise WeightSyncError("weights.group: missing or incomplete (the trainer and this side disagree on "
                                  "weight_sync.transport?)")
        self.accepted = version
        return msg

    async def load(self, client: GenerationClient, prepared: dict[str, Any], version: int) -> None:
        group = prepared["group"]
        rank = self._ranks.setdefault(client.address, len(self._ranks) + 1)
        if rank >= group["world_size"]:
            raise WeightSyncError(f"{client.address}: would be rank {rank} but the trainer's group has world_size "
                                  f"{group['world_size']} (set rollout.num_servers / rollout.server_addrs the same on "
                                  "both sides)")
        try:
            if self._joined.get(client.address) != group["group_name"]:
                if client.address in self._joined:  # an older group, torn down after a failure
                    await client.destroy_weights_update_group(self._joined.pop(client.address))
                await client.init_weights_update_group(
                    group["master_address"], group["master_port"], rank, group["world_size"], group["group_name"],
                    group.get("backend", "gloo"), timeout_s=self.deadline_s)
                self._joined[client.address] = group["group_name"]
            await client.update_weights_from_distributed(
                prepared["names"], prepared["dtypes"], prepared["shapes"], group["group_name"], version,
                load_format="flattened_bucket", bucket_bytes=prepared["bucket_bytes"],
                timeout_s=self.deadline_s)
        except Exception:
            self._joined.pop(client.address, None)  # it rejoins the next group
            raise

    async def release(self, prepared: dict[str, Any]) -> None:
        return None

    def superseded(self, prepared: dict[str, Any], version: int) -> bool:
        return False  # a broadcast leaves nothing to prune


# --------------------------------------------------------------------------- server side
class DistWeightGroups:
    """A generation server's groups by name; receives a version into a staged file."""

    def __init__(self, stage_dir: str | Path, device: torch.device | str = "cpu"):
        self.stage_dir = Path(stage_dir)
        self.device = torch.device(device)
        self.groups: dict[str, tuple[Any, Any, float]] = {}  # name -> (store, group, timeout_s)

    def init(self, master_address: str, master_port: int, rank: int, world_size: int, group_name: str,
             backend: str, timeout_s: float) -> None:
        """Join a group (blocking until it forms, at most `timeout_s`); replaces one of the same name."""
        self.destroy(group_name)
        try:
            store = dist.TCPStore(master_address, master_port, world_size, False,
                                  datetime.timedelta(seconds=timeout_s))
        except RuntimeError as exc:
            raise WeightSyncError(f"master_address: cannot reach the trainer's store at {master_address}:"
                                  f"{master_port} within {timeout_s:g}s ({str(exc).splitlines()[0][:200]})") from None
        self.groups[group_name] = (store, open_group(backend, store, group_name, rank, world_size, timeout_s),
                                   timeout_s)

    def destroy(self, group_name: str) -> bool:
        return self.groups.pop(group_name, None) is not None

    def receive(self, group_name: str, layout: WeightLayout, per_tensor: bool) -> Path:
        """Receive every bucket (or every tensor, `per_tensor`) into a staged file; return its path.
        On failure the group is dropped (the trainer drops it too) and the partial file removed."""
        if group_name not in self.groups:
            raise WeightSyncError(f"group_name: {group_name!r} is not initialised on this server "
                                  "(call /init_weights_update_group first)")
        _, group, timeout_s = self.groups[group_name]
        if per_tensor:
            layout = layout.per_tensor()
        stage = StagedFile(self.stage_dir / f"staged_v{layout.version:06d}.safetensors", layout)
        try:
            if per_tensor:
                for index, e in enumerate(layout.entries):
                    buf = torch.empty(e.shape, dtype=DTYPES[e.dtype][1], device=self.device)
                    _broadcast(group, buf, f"weights v{layout.version} tensor {e.name}", timeout_s)
                    stage.write(index, [byte_view(buf).cpu().numpy()])
            else:
                for index, (start, end) in enumerate(layout.buckets):
                    buf = torch.empty(end - start, dtype=torch.uint8, device=self.device)
                    _broadcast(group, buf, f"weights v{layout.version} bucket {index}", timeout_s)
                    stage.write(index, [buf.cpu().numpy()])
            return stage.finish()
        except BaseException:
            stage.abandon()
            self.destroy(group_name)
            raise


