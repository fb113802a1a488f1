"""The `zmq` weight transport: a version streams in checksummed buckets over the trajectory queue.

Trainer -> rollout, in order on the queue's connection (CONTROL maps):

    {"kind": "weights_manifest", "version", "names", "dtypes", "shapes", "aliases", "bucket_bytes", ...}
    {"kind": "weights_bucket", "version", "index", "crc32", "parts": [uint8 arrays]}   x num_buckets
    {"kind": "weights", "version", "transport": "zmq", "num_buckets"}                 (the commit)

The publisher sends one bucket at a time and waits until ZeroMQ has handed it to the
kernel before reading the next (`send(control, wait_s)`), so the trainer holds one
encoded bucket beyond its model. A bucket's parts are views of the model's tensors:
encoding copies them once, into the frame. There is no whole-model frame.

The receiver takes manifests and buckets straight from the queue client's receive task
(`attach`) and writes each bucket into a staged safetensors file in its run directory
(`staging.StagedFile`: length and CRC-32 checked, one bucket in memory). The commit
reaches the controller through the ordinary control stream; `prepare` then returns the
finished file, or raises the error that rejected the version (a manifest not newer than
the last one, a truncated or corrupted bucket, buckets missing). `load` asks each server
to load the file (`/update_weights_from_disk`, which real SGLang also serves).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from async_rl.protocols import GenerationClient
from async_rl.types import WireFormatError
from async_rl.weight_sync.disk import check_keep_last, prune, weights_filename
from async_rl.weight_sync.layout import WeightLayout, crc32
from async_rl.weight_sync.staging import BucketError, StagedFile, WeightSyncError, WeightVersionError

logger = logging.getLogger(__name__)

MANIFEST, BUCKET = "weights_manifest", "weights_bucket"


class ZmqWeightPublisher:
    """Trainer side. `send(control, wait_s)` broadcasts one CONTROL map and returns once it has left
    (`TrajectoryQueueServer.broadcast`), raising TimeoutError after `wait_s`."""

    def __init__(self, send: Callable[[dict[str, Any], float], Any], bucket_bytes: int, deadline_s: float):
        if not deadline_s > 0:
            raise ValueError(f"weight_sync.deadline_s: must be > 0, got {deadline_s}")
        self.send = send
        self.bucket_bytes = int(bucket_bytes)
        self.deadline_s = deadline_s
        self.last_version = -1
        self.stats: dict[str, float] = {}

    def publish(self, state_dict: dict[str, Any], version: int) -> dict[str, Any]:
        """Stream `state_dict` as `version`; return the commit message (the caller broadcasts it)."""
        if isinstance(version, int) and version <= self.last_version:
            raise WeightVersionError(f"version: {version} is not newer than the last published "
                                     f"({self.last_version})")
        t0 = time.perf_counter()
        deadline = time.monotonic() + self.deadline_s
        layout, tensors = WeightLayout.from_state_dict(state_dict, version=version, bucket_bytes=self.bucket_bytes)
        self._send({"kind": MANIFEST, **layout.to_wire()}, deadline, "the manifest")
        for index, (start, end) in enumerate(layout.buckets):
            parts = layout.read(tensors, start, end)
            self._send({"kind": BUCKET, "version": version, "index": index, "crc32": crc32(parts),
                        "parts": parts}, deadline, f"bucket {index}")
            del parts
        self.last_version = version
        self.stats = {"sync/publish_s": time.perf_counter() - t0, "sync/bytes": float(layout.data_len),
                      "sync/buckets": float(len(layout.buckets))}
        return {"kind": "weights", "version": version, "transport": "zmq", "num_buckets": len(layout.buckets)}

    def _send(self, control: dict[str, Any], deadline: float, what: str) -> None:
        try:
            self.send(control, max(0.0, deadline - time.monotonic()))
        except TimeoutError:
            raise WeightSyncError(f"weights v{control['version']}: {what} not sent within "
                                  f"weight_sync.deadline_s={self.deadline_s:g}s (is the rollout side reading?)") from None


class ZmqWeightReceiver:
    """Rollout side: buckets -> a staged file per version in `directory`; servers load the file."""

    def __init__(self, directory: str | Path, keep_last: int):
        self.directory = Path(directory).resolve()
        self.keep_last = check_keep_last(keep_last)
        self.accepted = -1  # newest version whose manifest was accepted
        self._stages: dict[int, StagedFile] = {}
        self._done: dict[int, Path] = {}
        self._failed: dict[int, str] = {}

    def attach(self, queue: Any) -> "ZmqWeightReceiver":
        """Take manifests and buckets from a `TrajectoryQueueClient` as they arrive."""
        for kind in (MANIFEST, BUCKET):
            queue.on_control(kind, self.handle)
        return self

    def handle(self, msg: dict[str, Any]) -> None:
        """One manifest or bucket; a bad one rejects its version (recorded for `prepare`), never raises."""
        version = msg.get("version")
        try:
            if msg.get("kind") == MANIFEST:
                self._manifest(msg)
            else:
                self._bucket(msg)
        except (WeightSyncError, WireFormatError, OSError) as exc:
            if isinstance(version, int):
                stage = self._stages.pop(version, None)
                if stage is not None:
                    stage.abandon()
                self._failed.setdefault(version, str(exc))
            logger.error("weights rejected: %s", exc)

    def _manifest(self, msg: dict[str, Any]) -> None:
        layout = WeightLayout.from_wire(msg)
        if layout.version <= self.accepted:
            raise WeightVersionError(f"weights manifest.version: v{layout.version} is not newer than "
                                     f"v{self.accepted}, already accepted (a version going backwards)")
        for v, stage in list(self._stages.items()):  # an older version that never completed
            logger.warning("weights v%d abandoned: %d of %d buckets arrived before v%d started", v,
                           len(stage.received), len(stage.layout.buckets), layout.version)
            stage.abandon()
            self._failed[v] = f"weights v{v}: truncated: superseded by v{layout.version} before it completed"
            del self._stages[v]
        self.accepted = layout.version
        stage = StagedFile(self.directory / weights_filename(layout.version), layout)
        self._stages[layout.version] = stage
        if stage.complete:  # no tensors at all
            self._complete(layout.version)

    def _bucket(self, msg: dict[str, Any]) -> None:
        version = msg.get("version")
        stage = self._stages.get(version)
        if stage is None:
            if version in self._failed:
                return  # the version is already rejected; the rest of its buckets are ignored
            raise BucketError(f"weights_bucket.version: v{version!r} has no manifest (lost, or out of order)")
        parts = msg.get("parts")
        if not isinstance(parts, list):
            raise BucketError(f"weights v{version}: weights_bucket.parts: expected a list of byte arrays")
        checksum = msg.get("crc32")
        if not isinstance(checksum, int):
            raise BucketError(f"weights v{version}: weights_bucket.crc32: missing")
        stage.write(msg.get("index"), parts, checksum)
        if stage.complete:
            self._complete(version)

    def _complete(self, version: int) -> None:
        self._done[version] = self._stages.pop(version).finish()
        prune(self.directory, version, self.keep_last)
        for v in [v for v in self._done if v <= version - self.keep_last]:
            del self._done[v]

    # ------------------------------------------------------------------ WeightReceiver
    async def prepare(self, msg: dict[str, Any]) -> str:
        version = int(msg["version"])
        if version in self._failed:
            raise WeightSyncError(self._failed.pop(version))
        if version in self._done:
            return str(self._done[version])
        stage = self._stages.pop(version, None)
        if stage is not None:
            stage.finish()  # raises: truncated, naming the missing buckets
        raise WeightSyncError(f"weights v{version}: the commit arrived but no manifest or bucket did "
                              "(the trainer and this side disagree on weight_sync.transport?)")

    async def load(self, client: GenerationClient, prepared: str, version: int) -> None:
        await client.update_weights_from_disk(prepared, version)

    async def release(self, prepared: str) -> None:
        return None
