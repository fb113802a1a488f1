"""Trainer-side weight publishers (`WeightPublisher`), chosen by `weight_sync.transport`.

    publisher = build_publisher(cfg, queue.broadcast)   # from PUBLISHERS
    msg = publisher.publish(trainer.weights(), version)  # read from the parameters, bucket by bucket
    if msg is not None:
        queue.broadcast(msg)                            # tells the rollout side (disk, zmq)

`broadcast(control, wait_s=None)` sends a CONTROL map to the rollout side; with `wait_s`
it returns once the map has left (the zmq transport's flow control).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from async_rl.config import Config
from async_rl.protocols import WeightPublisher
from async_rl.utils.hardware import resolve_device
from async_rl.weight_sync.disk import DiskWeightPublisher
from async_rl.weight_sync.dist_publisher import DistWeightPublisher
from async_rl.weight_sync.dist_receiver import WILDCARDS, host_of
from async_rl.weight_sync.group import choose_backend
from async_rl.weight_sync.receivers import keep_last, readers_lock
from async_rl.weight_sync.zmq_buckets import ZmqWeightPublisher

Broadcast = Callable[..., Any]


def bucket_bytes(cfg: Config) -> int:
    return max(1, int(cfg.weight_sync.bucket_mb * 2**20))


def trainer_host(cfg: Config) -> str:
    """The host in transport.addr, where the trainer binds: the dist group's store is announced there.
    "" for a wildcard bind (the rollout side then uses the host it reached the trainer's queue at)."""
    return "" if (host := host_of(cfg.transport.addr)) in WILDCARDS else host


def engine_devices(cfg: Config) -> list[str]:
    """The device type each generation server holds its weights on, as configured: SGLang is CUDA;
    the embedded engine's `engine.device` (`auto` as this machine resolves it)."""
    if cfg.engine.backend == "sglang":
        return ["cuda"]
    return [resolve_device(cfg.engine.device, "engine.device").type]


def wire_dtype(cfg: Config) -> torch.dtype | None:
    """The dtype weights travel in: the engine's where it is known without measuring (model.dtype set,
    SGLang, or a CUDA engine that runs bf16 natively); otherwise the trainer's own fp32, which is
    lossless whatever the engine then picks (`auto` on a CPU measures, so two processes may differ)."""
    if cfg.model.dtype != "auto":
        return getattr(torch, cfg.model.dtype)
    if cfg.engine.backend == "sglang":  # SGLang's auto runs the checkpoint's 16-bit dtype
        return torch.bfloat16
    if engine_devices(cfg) == ["cuda"] and torch.cuda.is_bf16_supported():
        return torch.bfloat16
    return None


def _disk(cfg: Config, broadcast: Broadcast) -> DiskWeightPublisher:
    return DiskWeightPublisher(Path(cfg.run_dir) / "weights", keep_last=keep_last(cfg), dtype=wire_dtype(cfg),
                               take_over=readers_lock(cfg))


def _zmq(cfg: Config, broadcast: Broadcast) -> ZmqWeightPublisher:
    return ZmqWeightPublisher(broadcast, bucket_bytes(cfg), cfg.weight_sync.deadline_s, dtype=wire_dtype(cfg))


def _dist(cfg: Config, broadcast: Broadcast) -> DistWeightPublisher:
    device = resolve_device(cfg.trainer.device, "trainer.device")
    servers = len(cfg.rollout.server_addrs) or cfg.rollout.num_servers
    return DistWeightPublisher(broadcast, 1 + servers * cfg.engine.tp_size, bucket_bytes(cfg),
                               cfg.weight_sync.deadline_s, host=trainer_host(cfg),
                               backend=choose_backend(device, engine_devices(cfg)), device=str(device),
                               dtype=wire_dtype(cfg))


PUBLISHERS: dict[str, Callable[[Config, Broadcast], WeightPublisher]] = {"disk": _disk, "zmq": _zmq, "dist": _dist}


def build_publisher(cfg: Config, broadcast: Broadcast) -> WeightPublisher:
    """The publisher of `weight_sync.transport`."""
    name = cfg.weight_sync.transport
    if name not in PUBLISHERS:
        raise ValueError(f"weight_sync.transport: {name!r} has no publisher; allowed: {', '.join(sorted(PUBLISHERS))}")
    return PUBLISHERS[name](cfg, broadcast)
