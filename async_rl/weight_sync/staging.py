"""Stage a streamed weight version in a file, bucket by bucket, then map it without copying.

`StagedFile` writes the safetensors header of a `WeightLayout` first, then each received
chunk at its place (`os.pwritev`), checking that it continues its bucket where the last one
stopped, its length and its CRC-32; `finish()` checks that every bucket arrived whole and
renames the file into place, so a reader never sees a half-written version. Memory held:
the chunk being written, nothing more.

The file of a version that this one's completion will prune anyway (`reuse`) is taken
over when nobody is reading it: writing into its page-cache pages is a plain copy, while
fresh pages cost 5-10x more on the machines measured (benchmarks/results/weight_sync.md).
Readers hold a shared `flock` while they map a file; the taker-over holds an exclusive one
just long enough to rename the file away, so a reader either finishes with the old version
or finds its path gone (reported as pruned), never a half-overwritten file.

`map_weights(path)` is the reading side: every tensor of a safetensors file (or of every
such file in a directory, as a Hugging Face checkpoint has) as a view of a memory map
(copy-on-write, never written back), so a swap copies each tensor once from the page
cache into the model and holds no second copy.

Every error names what was wrong (version, bucket index, expected vs got), and the
version it belongs to is abandoned: the weights in use do not change.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import json
import logging
import mmap
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from async_rl.weight_sync.layout import DTYPES, WeightLayout, crc32

logger = logging.getLogger(__name__)


def _libc_fallocate():
    try:
        fn = ctypes.CDLL(None, use_errno=True).fallocate
    except (AttributeError, OSError):  # not Linux
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    return fn


_FALLOCATE = _libc_fallocate()


def preallocate(fd: int, size: int) -> None:
    """Make the file `size` bytes long with its blocks reserved up front. Writing into a sparse file
    stalls on block allocation as dirty pages pile up (measured here: 0.3-0.5 GB/s against 6 GB/s
    into a reserved one); where the file system cannot reserve, the file is only extended."""
    if _FALLOCATE is not None and size > 0:
        if _FALLOCATE(fd, 0, 0, size) == 0:
            return
        if ctypes.get_errno() not in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
            raise OSError(ctypes.get_errno(), f"cannot reserve {size} bytes for a staged weight file "
                                              f"({os.strerror(ctypes.get_errno())})")
    os.ftruncate(fd, size)


def _take_over(old: Path, partial: Path) -> int | None:
    """Rename `old` to `partial` and return it open, unless a reader holds it (or it is gone): None."""
    try:
        fd = os.open(old, os.O_RDWR)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.replace(old, partial)
        fcntl.flock(fd, fcntl.LOCK_UN)
    except OSError:  # a reader has it mapped (or it was renamed meanwhile): write a new file instead
        os.close(fd)
        return None
    return fd


def write_all(fd: int, views: Sequence[memoryview], at: int) -> None:
    """Write the buffers back to back from file offset `at`, in as few system calls as it takes
    (one `pwritev` per chunk: each call lets go of the GIL and has to win it back)."""
    pending = [m for m in views if m.nbytes]
    while pending:
        n = os.pwritev(fd, pending[:_IOV_MAX], at) if _PWRITEV else os.pwrite(fd, pending[0], at)
        if n <= 0:
            raise OSError(f"short write at byte {at} of a staged weight file")
        at += n
        while pending and n >= pending[0].nbytes:
            n -= pending[0].nbytes
            pending.pop(0)
        if n:
            pending[0] = pending[0][n:]


_IOV_MAX = 1024
_PWRITEV = hasattr(os, "pwritev")


class WeightSyncError(RuntimeError):
    """A weight update was rejected; the weights in use stay as they were."""


class WeightVersionError(WeightSyncError):
    """A version that is not newer than the one already accepted."""


class BucketError(WeightSyncError):
    """A bucket that is truncated, corrupted, repeated or out of range."""


class WeightsSuperseded(WeightSyncError):
    """A version whose weights are gone because a newer version replaced them (pruned, `keep_last`):
    nothing is wrong with the servers; the newer version's message is already on its way."""


class StagedFile:
    """One version being assembled at `path` (written as `.path.partial`, renamed by `finish`)."""

    def __init__(self, path: str | Path, layout: WeightLayout, reuse: Path | None = None):
        self.path = Path(path)
        self.layout = layout
        self.received: set[int] = set()  # buckets complete
        self._filled: dict[int, int] = {}  # bucket -> bytes written so far (chunks arrive in order)
        self.stats = {"sync/recv_crc_s": 0.0, "sync/recv_write_s": 0.0, "sync/recv_cpu_s": 0.0,
                      "sync/recv_chunks": 0.0}
        self._partial = self.path.with_name(f".{self.path.name}.partial")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        header = layout.header()
        self._data_at = len(header)
        fd = _take_over(reuse, self._partial) if reuse is not None else None
        self.reused = fd is not None
        if fd is None:
            fd = os.open(self._partial, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        self._fd: int | None = fd
        try:
            size = self._data_at + layout.data_len
            if self.reused and os.fstat(self._fd).st_size > size:
                os.ftruncate(self._fd, size)
            os.pwrite(self._fd, header, 0)
            preallocate(self._fd, size)
        except OSError:
            self.abandon()
            raise

    @property
    def complete(self) -> bool:
        return len(self.received) == len(self.layout.buckets)

    def write(self, index: int, parts: Sequence[Any], checksum: int | None = None, offset: int = 0) -> None:
        """Write the chunk of bucket `index` that starts `offset` bytes into it (its bytes as a list of
        buffers; the whole bucket when the layout's chunk is the bucket); BucketError if it does not fit."""
        v, buckets = self.layout.version, self.layout.buckets
        if self._fd is None:
            raise BucketError(f"weights v{v}: bucket {index} arrived after the version was closed")
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < len(buckets):
            raise BucketError(f"weights v{v}: bucket index {index!r} out of range (the manifest has "
                              f"{len(buckets)} buckets)")
        if index in self.received:
            raise BucketError(f"weights v{v}: bucket {index} arrived twice")
        start, end = buckets[index]
        filled = self._filled.get(index, 0)
        if offset != filled:
            raise BucketError(f"weights v{v}: bucket {index}: a chunk at byte {offset!r} arrived, expected byte "
                              f"{filled} (a chunk was lost or came out of order)")
        views = [memoryview(p).cast("B") for p in parts]
        got, want = sum(m.nbytes for m in views), min(self.layout.chunk_bytes, end - start - offset)
        if got != want:
            raise BucketError(f"weights v{v}: bucket {index} is truncated or oversized: {got} bytes at byte {offset}, "
                              f"expected {want} (bytes {start}..{end} of {self.layout.data_len})")
        t0, c0 = time.perf_counter(), time.thread_time()
        if checksum is not None and crc32(views) != checksum:
            raise BucketError(f"weights v{v}: bucket {index} is corrupted (CRC-32 {crc32(views):#010x}, "
                              f"expected {checksum:#010x})")
        t1 = time.perf_counter()
        write_all(self._fd, views, self._data_at + start + offset)
        t2, c2 = time.perf_counter(), time.thread_time()
        self.stats["sync/recv_crc_s"] += t1 - t0
        self.stats["sync/recv_write_s"] += t2 - t1
        self.stats["sync/recv_cpu_s"] += c2 - c0
        self.stats["sync/recv_chunks"] += 1
        self._filled[index] = filled + got
        if filled + got == end - start:
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
    """Every tensor of a safetensors file, or of every .safetensors file in a directory (aliases
    restored), as zero-copy views of private memory maps."""
    p = Path(path)
    if p.is_dir():
        files = sorted(p.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"model_path: no .safetensors file in directory {str(p)!r}")
        out: dict[str, torch.Tensor] = {}
        for f in files:
            out.update(_map_file(f))
        return out
    if not p.is_file():
        raise FileNotFoundError(f"model_path: {str(p)!r} does not exist")
    return _map_file(p)


def _map_file(p: Path) -> dict[str, torch.Tensor]:
    with p.open("rb") as fh:
        fcntl.flock(fh, fcntl.LOCK_SH)  # held by the map's own descriptor until the map is gone
        st = os.fstat(fh.fileno())
        try:
            now = os.stat(p)
        except FileNotFoundError:
            now = None
        if now is None or (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
            raise FileNotFoundError(f"model_path: {str(p)!r} was pruned (weight_sync.keep_last) while being loaded")
        size = st.st_size
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

