"""Rollout-side receivers of the weight transports (`WeightReceiver`), chosen by `weight_sync.transport`.

    receiver = build_receiver(cfg, queue)      # from RECEIVERS; `queue` feeds the zmq buckets
    prepared = await receiver.prepare(msg)     # once per version (the "weights" control message)
    await receiver.load(client, prepared, v)   # once per generation server (under a deadline)
    await receiver.release(prepared)
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from async_rl.config import Config
from async_rl.protocols import GenerationClient, WeightReceiver
from async_rl.weight_sync.dist_receiver import DistWeightReceiver, host_of
from async_rl.weight_sync.versions import superseded
from async_rl.weight_sync.zmq_buckets import ZmqWeightReceiver


class DiskWeightReceiver:
    """`disk`: the message names a version directory on a shared file system; each server loads it."""

    async def prepare(self, msg: dict[str, Any]) -> str:
        return str(msg["path"])

    async def load(self, client: GenerationClient, prepared: str, version: int) -> None:
        await client.update_weights_from_disk(prepared, version)

    async def release(self, prepared: str) -> None:
        return None

    def superseded(self, prepared: str, version: int) -> bool:
        return superseded(prepared, version)


def keep_last(cfg: Config) -> int:
    """Versions kept on disk: enough for the staleness bound (the trainer runs up to eta + 1 ahead)."""
    eta = 0 if cfg.mode == "sync" else cfg.max_staleness
    return max(cfg.weight_sync.keep_last, eta + 2)


def readers_lock(cfg: Config) -> bool:
    """Whether every server that loads weights is an embedded engine this run starts: it holds a read lock
    while it maps a version, so the file of a version being pruned may be written over when unlocked.
    SGLang (`engine.backend=sglang`, or any server in `rollout.server_addrs`) maps files without one."""
    return cfg.engine.backend == "embedded" and not cfg.rollout.server_addrs


def _disk(cfg: Config, queue: Any) -> DiskWeightReceiver:
    return DiskWeightReceiver()


def _zmq(cfg: Config, queue: Any) -> ZmqWeightReceiver:
    receiver = ZmqWeightReceiver(Path(cfg.run_dir) / "weights", keep_last(cfg), take_over=readers_lock(cfg))
    if queue is not None:
        receiver.attach(queue)
    return receiver


def _dist(cfg: Config, queue: Any) -> DistWeightReceiver:
    return DistWeightReceiver(cfg.weight_sync.deadline_s, trainer_host=host_of(getattr(queue, "addr", "")
                                                                                or cfg.transport.addr))


RECEIVERS: dict[str, Callable[[Config, Any], WeightReceiver]] = {"disk": _disk, "zmq": _zmq, "dist": _dist}


def build_receiver(cfg: Config, queue: Any = None) -> WeightReceiver:
    """The receiver of `weight_sync.transport`; `queue` (a TrajectoryQueueClient) delivers zmq buckets."""
    name = cfg.weight_sync.transport
    if name not in RECEIVERS:
        raise ValueError(f"weight_sync.transport: {name!r} has no receiver here; allowed: {', '.join(sorted(RECEIVERS))}")
    return RECEIVERS[name](cfg, queue)
