"""Stage a streamed weight version in a file, bucket by bucket, then map it without copying.

`StagedFile` writes the safetensors header of a `WeightLayout` first, then each received
byte range at its place (`os.pwrite`), checking its length and CRC-32; `finish()` checks
that every bucket arrived and renames the file into place, so a reader never sees a
half-written version. Memory held: the bucket being written, nothing more.

`map_weights(path)` is the reading side: every tensor of a safetensors file as a view of
one read-only-by-convention memory map (copy-on-write, never written back), so a swap
copies each tensor once from the page cache into the model and holds no second copy.

Every error names what was wrong (version, bucket index, expected vs got), and the
version it belongs to is abandoned: the weights in use do not change.
"""

from __future__ import annotations

import json
import logging
import mmap
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from async_rl.weight_sync.layout import DTYPES, WeightLayout, crc32

logger = logging.getLogger(__name__)


class WeightSyncError(RuntimeError):
    """A weight update was rejected; the weights in use stay as they were."""


class WeightVersionError(WeightSyncError):
    """A version that is not newer than the one already accepted."""


class BucketError(WeightSyncError):
    """A bucket that is truncated, corrupted, repeated or out of range."""


class StagedFile:
    """One version being assembled at `path` (written as `.path.partial`, renamed by `finish`)."""

    def __init__(self, path: str | Path, layout: WeightLayout):
        self.path = Path(path)
        self.layout = layout
        self.received: set[int] = set()
        self._partial = self.path.with_name(f".{self.path.name}.partial")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        header = layout.header()
        self._data_at = len(header)
        self._fd: int | None = os.open(self._partial, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        os.pwrite(self._fd, header, 0)
        os.ftruncate(self._fd, self._data_at + layout.data_len)

    @property
    def complete(self) -> bool:
        return len(self.received) == len(self.layout.buckets)

    def write(self, index: int, parts: Sequence[Any], checksum: int | None = None) -> None:
        """Write bucket `index` (its bytes as a list of buffers); BucketError if it does not fit."""
        v, buckets = self.layout.version, self.layout.buckets
        if self._fd is None:
            raise BucketError(f"weights v{v}: bucket {index} arrived after the version was closed")
        if not isinstance(index, int) or not 0 <= index < len(buckets):
            raise BucketError(f"weights v{v}: bucket index {index!r} out of range (the manifest has "
                              f"{len(buckets)} buckets)")
        if index in self.received:
            raise BucketError(f"weights v{v}: bucket {index} arrived twice")
        start, end = buckets[index]
        views = [memoryview(p).cast("B") for p in parts]
        got = sum(m.nbytes for m in views)
        if got != end - start:
            raise BucketError(f"weights v{v}: bucket {index} is truncated or oversized: {got} bytes, expected "
                              f"{end - start} (bytes {start}..{end} of {self.layout.data_len})")
        if checksum is not None and crc32(views) != checksum:
            raise BucketError(f"weights v{v}: bucket {index} is corrupted (CRC-32 {crc32(views):#010x}, "
                              f"expected {checksum:#010x})")
        at = self._data_at + start
        for m in views:
            written = 0
            while written < m.nbytes:
                written += os.pwrite(self._fd, m[written:], at + written)
            at += m.nbytes
        self.received.add(index)

    def finish(self) -> Path:
        """Close and rename into place; BucketError naming the missing buckets if any did not arrive."""
        if not self.complete:
            missing = sorted(set(range(len(self.layout.buckets))) - self.received)
            self.abandon()
            raise BucketError(f"weights v{self.layout.version}: truncated: {len(self.received)} of "
                              f"{len(self.layout.buckets)} buckets arrived (missing {missing[:8]})")
        self._close()
        os.replace(self._partial, self.path)
        return self.path

    def abandon(self) -> None:
        """Drop the partial file (the weights in use are untouched)."""
        self._close()
        self._partial.unlink(missing_ok=True)

    def _close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def map_weights(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors file (aliases restored) as zero-copy views of a private memory map."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"model_path: {str(p)!r} does not exist")
    with p.open("rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        if size < 8:
            raise ValueError(f"{p}: {size} bytes is too short for a safetensors file")
        mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY)
    n = int.from_bytes(mm[:8], "little")
    if not 0 < n <= size - 8:
        raise ValueError(f"{p}: header length {n} does not fit in {size} bytes (not a safetensors file?)")
    try:
        head = json.loads(mm[8:8 + n])
    except ValueError:
        raise ValueError(f"{p}: the header is not JSON (not a safetensors file?)") from None
    meta = head.pop("__metadata__", None) or {}
    base = 8 + n
    by_st = {st: td for st, td in DTYPES.values()}
    out: dict[str, torch.Tensor] = {}
    for name, spec in head.items():
        dtype = by_st.get(spec.get("dtype"))
        start, end = spec.get("data_offsets", (0, -1))
        if dtype is None or not 0 <= start <= end <= size - base:
            raise ValueError(f"{p}: tensor {name!r} has a bad dtype or offsets ({spec})")
        count = (end - start) // dtype.itemsize
        flat = torch.frombuffer(mm, dtype=dtype, count=count, offset=base + start) if count else \
            torch.empty(0, dtype=dtype)
        out[name] = flat.view(spec["shape"])
    for alias, name in json.loads(meta.get("aliases", "{}")).items():
        out[alias] = out[name]
    return out

