"""The `zmq` weight transport: a version streams in checksummed buckets over the trajectory queue.

Trainer -> rollout, in order on the queue's connection:

    BULK {"kind": "weights_manifest", "version", "names", "dtypes", "shapes", "aliases", "bucket_bytes",
          "chunk_bytes", ...}
    BULK {"kind": "weights_bucket", "version", "index", "offset", "crc32"} + raw frames   x chunks
    CONTROL {"kind": "weights", "version", "transport": "zmq", "num_buckets"}             (the commit)

Each bucket travels as chunks (at most `chunk_bytes_for(bucket_bytes)`, a quarter of a
bucket up to 16 MiB), each with the CRC-32 of its bytes. A chunk's frames are views of the
model's tensors, sent as they are: the trainer encodes no copy, and no frame holds the whole
model. Flow control is a byte window of one bucket (`transport/bulk.py`): a chunk leaves only
while the rollout side has acknowledged all but at most one bucket's worth, and a receiver
acknowledges a chunk once it is written and dropped, so the rollout side holds at most one
bucket while chunks keep the link, the checksums and the writes busy at the same time.
`publish` returns once every chunk is acknowledged, i.e. staged (so the model may change).

The receiver takes manifests and chunks from the queue client's bulk worker thread
(`attach`) and writes each chunk into the version's staged directory in its run directory
(`versions.StagedVersion`, a `staging.StagedFile`: order, length and CRC-32 checked). The
commit reaches the controller through the ordinary control stream, after every chunk before
it was handled; `prepare` then returns the finished version directory (`weights/vNNNNNN`,
`model.safetensors` inside), or raises the error that rejected the version (a manifest not
newer than the last one, a truncated or corrupted bucket, buckets missing). `load` asks each
server to load the directory (`/update_weights_from_disk`, which real SGLang also serves;
the embedded server swaps it in from a memory map).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from async_rl.protocols import GenerationClient
from async_rl.types import WireFormatError
from async_rl.utils.weights import WeightSource, as_source
from async_rl.weight_sync.layout import WeightLayout, crc32
from async_rl.weight_sync.staging import BucketError, WeightSyncError, WeightsSuperseded
from async_rl.weight_sync.versions import (StagedVersion, check_keep_last, check_newer, prune, stale_dirs,
                                            superseded)

logger = logging.getLogger(__name__)

MANIFEST, BUCKET = "weights_manifest", "weights_bucket"
MAX_CHUNK_BYTES = 16 << 20


def chunk_bytes_for(bucket_bytes: int) -> int:
    """A quarter of a bucket, at most 16 MiB: enough chunks in the one-bucket window to overlap the
    sender's checksum, the transfer and the receiver's write; few enough to cost nothing per chunk."""
    return max(1, min(MAX_CHUNK_BYTES, -(-bucket_bytes // 4)))


def _process_cpu_s() -> float:
    """CPU seconds of this process, all threads (ZeroMQ's I/O thread and the kernel's copies included)."""
    t = os.times()
    return t.user + t.system


class ZmqWeightPublisher:
    """Trainer side. `send(control, wait_s, parts=..., window_bytes=...)` is
    `TrajectoryQueueServer.broadcast`: it sends one BULK once the window has room (TimeoutError
    after `wait_s`) and returns a ticket whose `wait(timeout)` returns once every producer handled it."""

    def __init__(self, send: Callable[..., Any], bucket_bytes: int, deadline_s: float,
                 dtype: torch.dtype | None = None):
        if not deadline_s > 0:
            raise ValueError(f"weight_sync.deadline_s: must be > 0, got {deadline_s}")
        self.send = send
        self.dtype = dtype  # floating tensors travel in this dtype (the engine's); None: as the model holds them
        self.bucket_bytes = int(bucket_bytes)
        self.deadline_s = deadline_s
        self.last_version = -1
        self.stats: dict[str, float] = {}

    def publish(self, weights: Any, version: int) -> dict[str, Any]:
        """Stream `weights` (a `WeightSource`, read tensor by tensor, or a state dict) as `version`; return
        the commit message (the caller broadcasts it)."""
        source = as_source(weights)
        try:
            return self._publish(source, version)
        finally:
            source.close()

    def _publish(self, source: WeightSource, version: int) -> dict[str, Any]:
        # the same version again is a replay for a rollout side that joined; receivers that hold it skip it
        if isinstance(version, int):
            check_newer(version, self.last_version, field="version", current_is="the last published", replay_ok=True)
        t0, cpu0 = time.perf_counter(), _process_cpu_s()
        deadline = time.monotonic() + self.deadline_s
        layout, tensors = WeightLayout.from_source(source, self.dtype, version=version, bucket_bytes=self.bucket_bytes,
                                                   chunk_bytes=chunk_bytes_for(self.bucket_bytes))
        ticket = self._send({"kind": MANIFEST, **layout.to_wire()}, [], deadline, "the manifest")
        crc_s = wait_s = 0.0
        for index, (start, _) in enumerate(layout.buckets):
            for lo, hi in layout.chunks(index):
                parts = layout.read(tensors, lo, hi)
                t1 = time.perf_counter()
                checksum = crc32(parts)
                t2 = time.perf_counter()
                ticket = self._send({"kind": BUCKET, "version": version, "index": index, "offset": lo - start,
                                     "crc32": checksum}, parts, deadline, f"bucket {index}") or ticket
                crc_s, wait_s = crc_s + t2 - t1, wait_s + time.perf_counter() - t2
                del parts
        t3 = time.perf_counter()
        if ticket is not None:  # the model may change once every chunk is staged on the rollout side
            try:
                ticket.wait(max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                raise self._late(version, "the last bucket", "staged by the rollout side") from None
        self.last_version = version
        self.stats = {"sync/publish_s": time.perf_counter() - t0, "sync/bytes": float(layout.data_len),
                      "sync/buckets": float(len(layout.buckets)), "sync/crc_s": crc_s, "sync/window_wait_s": wait_s,
                      "sync/drain_s": time.perf_counter() - t3, "sync/publish_cpu_s": _process_cpu_s() - cpu0}
        return {"kind": "weights", "version": version, "transport": "zmq", "num_buckets": len(layout.buckets)}

    def _send(self, control: dict[str, Any], parts: list[Any], deadline: float, what: str) -> Any:
        try:
            return self.send(control, max(0.0, deadline - time.monotonic()), parts=parts,
                             window_bytes=self.bucket_bytes)
        except TimeoutError:
            raise self._late(control["version"], what) from None

    def _late(self, version: int, what: str, done: str = "sent") -> WeightSyncError:
        return WeightSyncError(f"weights v{version}: {what} not {done} within weight_sync.deadline_s="
                               f"{self.deadline_s:g}s (is the rollout side reading?)")


class ZmqWeightReceiver:
    """Rollout side: buckets -> a staged directory per version in `directory`; servers load the directory.
    `handle` runs in the queue client's bulk thread and `prepare` on the event loop: a lock keeps
    their view of the versions consistent."""

    def __init__(self, directory: str | Path, keep_last: int, take_over: bool = True):
        self.directory = Path(directory).resolve()
        self.keep_last = check_keep_last(keep_last)
        self.take_over = take_over  # False where a server may not lock what it loads (SGLang): see disk.py
        self.accepted = -1  # newest version whose manifest was accepted
        self.stats: dict[str, float] = {}  # the last completed version's sync/recv_* timings
        self._stages: dict[int, StagedVersion] = {}
        self._done: dict[int, Path] = {}
        self._replayed: set[int] = set()  # versions sent again (for a joining side) that we already hold
        self._failed: dict[int, str] = {}
        self._abandoned: set[int] = set()  # versions in _failed because a newer one started
        self._lock = threading.Lock()

    def attach(self, queue: Any) -> "ZmqWeightReceiver":
        """Take manifests and buckets from a `TrajectoryQueueClient` as they arrive."""
        for kind in (MANIFEST, BUCKET):
            queue.on_control(kind, self.handle)
        return self

    def handle(self, msg: dict[str, Any]) -> str | None:
        """One manifest or chunk; a bad one rejects its version (recorded for `prepare`) and returns the
        reason (sent back to the trainer); never raises."""
        version = msg.get("version")
        with self._lock:
            try:
                if msg.get("kind") == MANIFEST:
                    self._manifest(msg)
                else:
                    return self._bucket(msg)
            except (WeightSyncError, WireFormatError, OSError) as exc:
                if isinstance(version, int):
                    stage = self._stages.pop(version, None)
                    if stage is not None:
                        stage.abandon()
                    self._failed.setdefault(version, str(exc))
                logger.error("weights rejected: %s", exc)
                return str(exc)
        return None

    def _manifest(self, msg: dict[str, Any]) -> None:
        layout = WeightLayout.from_wire(msg)
        if layout.version == self.accepted and layout.version in self._done:
            self._replayed.add(layout.version)  # sent again for a side that joined: we hold it already
            return
        check_newer(layout.version, self.accepted, field="weights manifest.version",
                    current_is="the version already accepted")
        for v, stage in list(self._stages.items()):  # an older version that never completed
            logger.warning("weights v%d abandoned: %d of %d buckets arrived before v%d started", v,
                           len(stage.received), len(stage.layout.buckets), layout.version)
            stage.abandon()
            self._failed[v] = f"weights v{v}: truncated: superseded by v{layout.version} before it completed"
            self._abandoned.add(v)
            del self._stages[v]
        self.accepted = layout.version
        self.directory.mkdir(parents=True, exist_ok=True)
        stale = stale_dirs(self.directory, layout.version, self.keep_last)  # pruned once this one completes
        stage = StagedVersion(self.directory, layout, reuse=stale[0] if stale and self.take_over else None)
        self._stages[layout.version] = stage
        if stage.complete:  # no tensors at all
            self._complete(layout.version)

    def _bucket(self, msg: dict[str, Any]) -> str | None:
        version = msg.get("version")
        stage = self._stages.get(version)
        if stage is None:
            if version in self._replayed:
                return None  # a chunk of a replayed version we already hold
            if version in self._failed:
                return self._failed[version]  # already rejected; the rest of its chunks are ignored
            raise BucketError(f"weights_bucket.version: v{version!r} has no manifest (lost, or out of order)")
        parts = msg.get("parts")
        if not isinstance(parts, list):
            raise BucketError(f"weights v{version}: weights_bucket.parts: expected a list of byte arrays")
        checksum = msg.get("crc32")
        if not isinstance(checksum, int):
            raise BucketError(f"weights v{version}: weights_bucket.crc32: missing")
        stage.write(msg.get("index"), parts, checksum, msg.get("offset", 0))
        if stage.complete:
            self._complete(version)
        return None

    def _complete(self, version: int) -> None:
        stage = self._stages.pop(version)
        self._done[version] = stage.finish()
        self.stats = dict(stage.stats)
        prune(self.directory, version, self.keep_last)
        for v in [v for v in self._done if v <= version - self.keep_last]:
            del self._done[v]

    # ------------------------------------------------------------------ WeightReceiver
    async def prepare(self, msg: dict[str, Any]) -> str:
        with self._lock:
            return self._prepare(int(msg["version"]))

    def _prepare(self, version: int) -> str:
        if version in self._failed:
            why = self._failed.pop(version)
            # one the sender gave up on for a newer version is skipped, not an error: the newer one loads
            abandoned = version in self._abandoned
            self._abandoned.discard(version)
            raise (WeightsSuperseded if abandoned else WeightSyncError)(why)
        if version in self._done:
            return str(self._done[version])
        newer = [v for v in self._done if v > version]
        if newer:  # completed, then pruned behind a newer one before its commit was handled
            raise WeightsSuperseded(f"weights v{version}: superseded by v{max(newer)} (pruned, weight_sync.keep_last)")
        stage = self._stages.pop(version, None)
        if stage is not None:
            stage.finish()  # raises: truncated, naming the missing buckets
        raise WeightSyncError(f"weights v{version}: the commit arrived but no manifest or bucket did "
                              "(the trainer and this side disagree on weight_sync.transport?)")

    async def load(self, client: GenerationClient, prepared: str, version: int) -> None:
        await client.update_weights_from_disk(prepared, version)

    async def release(self, prepared: str) -> None:
        return None

    def superseded(self, prepared: str, version: int) -> bool:
        return superseded(prepared, version)
