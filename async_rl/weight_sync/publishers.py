"""Trainer-side weight publishers (`WeightPublisher`), chosen by `weight_sync.transport`.

    publisher = build_publisher(cfg, queue.broadcast)   # from PUBLISHERS
    msg = publisher.publish(model.state_dict(), version)
    if msg is not None:
        queue.broadcast(msg)                            # tells the rollout side (disk, zmq)

`broadcast(control, wait_s=None)` sends a CONTROL map to the rollout side; with `wait_s`
it returns once the map has left (the zmq transport's flow control).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from async_rl.config import Config
from async_rl.protocols import WeightPublisher
from async_rl.utils.hardware import resolve_device
from async_rl.weight_sync.disk import DiskWeightPublisher
from async_rl.weight_sync.dist import DistWeightPublisher
from async_rl.weight_sync.receivers import keep_last, readers_lock
from async_rl.weight_sync.zmq_buckets import ZmqWeightPublisher

Broadcast = Callable[..., Any]


def bucket_bytes(cfg: Config) -> int:
    return max(1, int(cfg.weight_sync.bucket_mb * 2**20))


def trainer_host(cfg: Config) -> str:
    """The host the rollout side reaches the trainer at (from transport.addr), for the dist group's store."""
    addr = cfg.transport.addr
    host = addr.split("://", 1)[-1].rsplit(":", 1)[0] if addr.startswith("tcp://") else "127.0.0.1"
    return "127.0.0.1" if host in ("*", "0.0.0.0", "") else host.strip("[]")


def _disk(cfg: Config, broadcast: Broadcast) -> DiskWeightPublisher:
    return DiskWeightPublisher(Path(cfg.run_dir) / "weights", keep_last=keep_last(cfg), take_over=readers_lock(cfg))


def _zmq(cfg: Config, broadcast: Broadcast) -> ZmqWeightPublisher:
    return ZmqWeightPublisher(broadcast, bucket_bytes(cfg), cfg.weight_sync.deadline_s)


def _dist(cfg: Config, broadcast: Broadcast) -> DistWeightPublisher:
    device = resolve_device(cfg.trainer.device, "trainer.device")
    return DistWeightPublisher(broadcast, len(cfg.rollout.server_addrs) or cfg.rollout.num_servers, bucket_bytes(cfg),
                               cfg.weight_sync.deadline_s, host=trainer_host(cfg),
                               backend="nccl" if device.type == "cuda" else "gloo", device=str(device))


PUBLISHERS: dict[str, Callable[[Config, Broadcast], WeightPublisher]] = {"disk": _disk, "zmq": _zmq, "dist": _dist}


def build_publisher(cfg: Config, broadcast: Broadcast) -> WeightPublisher:
    """The publisher of `weight_sync.transport`."""
    name = cfg.weight_sync.transport
    if name not in PUBLISHERS:
        raise ValueError(f"weight_sync.transport: {name!r} has no publisher; allowed: {', '.join(sorted(PUBLISHERS))}")
    return PUBLISHERS[name](cfg, broadcast)
