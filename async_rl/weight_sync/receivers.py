"""Rollout-side receivers of the weight transports (`WeightReceiver`), chosen by `weight_sync.transport`.

    receiver = build_receiver(cfg)             # from RECEIVERS
    prepared = await receiver.prepare(msg)     # once per version
    await receiver.load(client, prepared, v)   # once per generation server (under a deadline)
    await receiver.release(prepared)
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from async_rl.config import Config
from async_rl.protocols import GenerationClient
from async_rl.weight_sync.disk import ZmqWeightPayload


class DiskWeightReceiver:
    """`disk`: the message names a file on a shared file system; each server loads it."""

    async def prepare(self, msg: dict[str, Any]) -> str:
        return str(msg["path"])

    async def load(self, client: GenerationClient, prepared: str, version: int) -> None:
        await client.update_weights_from_disk(prepared, version)

    async def release(self, prepared: str) -> None:
        return None


class ZmqWeightReceiver(DiskWeightReceiver):
    """`zmq`: the file's bytes travel in the message; written into this side's run directory first."""

    def __init__(self, directory: str | Path, keep_last: int):
        self.directory = Path(directory)
        self.keep_last = keep_last

    async def prepare(self, msg: dict[str, Any]) -> str:
        if msg.get("blob") is None:
            return str(msg["path"])
        out = await asyncio.to_thread(ZmqWeightPayload.write_received, msg["blob"], self.directory,
                                      int(msg["version"]), self.keep_last)
        return str(out)


def _disk(cfg: Config) -> DiskWeightReceiver:
    return DiskWeightReceiver()


def _zmq(cfg: Config) -> ZmqWeightReceiver:
    return ZmqWeightReceiver(Path(cfg.run_dir) / "weights", max(cfg.weight_sync.keep_last, cfg.max_staleness + 2))


RECEIVERS = {"disk": _disk, "zmq": _zmq}


def build_receiver(cfg: Config):
    """The receiver of `weight_sync.transport`."""
    name = cfg.weight_sync.transport
    if name not in RECEIVERS:
        raise ValueError(f"weight_sync.transport: {name!r} has no receiver here; allowed: {', '.join(sorted(RECEIVERS))}")
    return RECEIVERS[name](cfg)
