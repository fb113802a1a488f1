"""The `dist` transport, trainer side: rank 0 of the weight group broadcasts a version bucket by bucket.

At its first publish the trainer opens a TCPStore on a free port, announces the group in
the version's "weights" CONTROL message (`master_address`, `master_port`, `world_size`,
`group_name`, `backend`) with the tensor list (`names`, `dtypes`, `shapes`, `aliases`) and
the bucket plan (`buckets`: index ranges into the names), then joins the group as rank 0
(`group.new_group`, the way SGLang joins it) and waits for the servers' ranks. Each bucket
is packed from the parameters, in the dtype on the wire, into one uint8 buffer on the
trainer's device that every bucket reuses (`flat_bucket.pack`: the only copy a publish
makes), and broadcast once, matching one `/update_weights_from_distributed` request with
`load_format="flattened_bucket"` on every server (`dist_receiver.py`).

`world_size` is 1 + every server's tensor-parallel ranks (SGLang puts a server's TP rank t
at `rank_offset + t`). The whole version must be broadcast within `weight_sync.deadline_s`;
on any failure the group is aborted (`group.close(failed=True)`) and the error raised (the
weights in use stay as they were everywhere); the next publish forms a fresh group under a
new name. The same version again is a replay for a rollout side that joined after it was
published: that side's servers hold no rank in the current group (its peers may be dead), so
the group is aborted and the replay forms a fresh one that every server joins.
`master_address` is the host in `transport.addr`; for a wildcard bind it is left
empty and the rollout side uses the host it reached the trainer's queue at.
"""

from __future__ import annotations

import datetime
import itertools
import logging
import os
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from async_rl.utils.weights import as_source
from async_rl.weight_sync import flat_bucket, group
from async_rl.weight_sync.staging import WeightSyncError
from async_rl.weight_sync.versions import check_newer

logger = logging.getLogger(__name__)

_NAMES = itertools.count(1)  # group names are unique in this process (torch's group table is per process)


class DistWeightPublisher:
    """Rank 0. `send(control)` broadcasts a CONTROL map to the rollout side (the trajectory queue)."""

    def __init__(self, send: Callable[[dict[str, Any]], Any], world_size: int, bucket_bytes: int,
                 deadline_s: float, host: str = "127.0.0.1", backend: str = "gloo", device: str = "cpu",
                 dtype: torch.dtype | None = None):
        if world_size < 2:
            raise ValueError(f"rollout.num_servers: the dist transport needs at least one server rank, "
                             f"got a group of {world_size}")
        if backend not in group.BACKENDS:
            raise ValueError(f"weight_sync backend: {backend!r} is not supported (allowed: {', '.join(group.BACKENDS)})")
        self.send, self.world_size = send, world_size
        self.bucket_bytes, self.deadline_s = int(bucket_bytes), deadline_s
        self.host, self.backend, self.device, self.dtype = host, backend, torch.device(device), dtype
        self.last_version = -1
        self.generation = 0
        self._store: Any = None
        self._group: Any = None
        self._name = ""
        self.stats: dict[str, float] = {}
        group.close_at_exit(self.close)

    def publish(self, weights: Any, version: int) -> None:
        """Announce `version` over the queue, then broadcast it; returns None (the message already went).
        `weights`: a `WeightSource` (read tensor by tensor) or a state dict."""
        if isinstance(version, int):
            check_newer(version, self.last_version, field="version", current_is="the last published", replay_ok=True)
        if version == self.last_version and self._store is not None:
            self.close(failed=True)  # a replay for a side that joined: a fresh group, every server in it
        t0 = time.perf_counter()
        source = as_source(weights)
        try:
            names, dtypes, shapes = source.specs(self.dtype)
            buckets = flat_bucket.plan(dtypes, shapes, self.bucket_bytes)
            info = self._announce_group()
            self.send({"kind": "weights", "version": version, "transport": "dist", "group": info, "names": names,
                       "dtypes": dtypes, "shapes": shapes, "aliases": source.aliases, "buckets": buckets})
            sent = self._broadcast(source, names, dtypes, shapes, buckets, version)
        finally:
            source.close()
        self.last_version = version
        self.stats = {"sync/publish_s": time.perf_counter() - t0, "sync/bytes": float(sent),
                      "sync/buckets": float(len(buckets))}
        return None

    def _announce_group(self) -> dict[str, Any]:
        if self._store is None:
            self.generation += 1
            self._name = f"async_rl_weights_{os.getpid()}_{next(_NAMES)}"
            self._store = dist.TCPStore(self.host or "127.0.0.1", 0, self.world_size, True,
                                        datetime.timedelta(seconds=self.deadline_s), wait_for_workers=False)
        return {"master_address": self.host, "master_port": self._store.port, "world_size": self.world_size,
                "group_name": self._name, "backend": self.backend}

    def _broadcast(self, source, names, dtypes, shapes, buckets, version: int) -> int:
        deadline = time.monotonic() + self.deadline_s
        sent = 0
        try:
            if self._group is None:
                self._group = group.new_group(self.backend, self._store, self._name, 0, self.world_size,
                                              self.deadline_s)
            # one buffer for every bucket: a collective may hold on to its tensor a while after it completes
            largest = max((flat_bucket.offsets(dtypes[a:b], shapes[a:b])[1] for a, b in buckets), default=0)
            buffer = torch.empty(largest, dtype=torch.uint8, device=self.device)
            for index, (a, b) in enumerate(buckets):
                flat = flat_bucket.pack(source, names[a:b], dtypes[a:b], shapes[a:b], self.device, out=buffer)
                group.broadcast(self._group, flat, f"weights v{version} bucket {index}", self.deadline_s, deadline)
                sent += flat.numel()
        except WeightSyncError:
            self.close(failed=True)  # a fresh group (new name) forms at the next publish
            raise
        return sent

    def close(self, failed: bool = False) -> None:
        group.close(self._group, failed=failed)
        self._group = None
        self._store = None
