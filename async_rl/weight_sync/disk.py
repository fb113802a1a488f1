"""The `disk` weight transport: the trainer writes safetensors files and only the path travels.

The trainer writes `weights_v{version:06d}.safetensors` and the rollout side (which shares
its file system) loads that path into each server. The streaming transports (`zmq.py`,
`dist_*.py`) stream the same tensors; zmq stages files of this format on the receiving side.

Files are written under a temporary name and renamed, so a reader never sees half a
file: the publisher lays a version out as the streaming transports do (`layout.py`) and
writes the model's tensors straight into a `staging.StagedFile`, taking over the file of
the version it is about to prune when nobody is reading it (no serialised copy, no fresh
page cache). Tensors that are one tensor in the model (a tied embedding and LM head) are
stored once; the other names are recorded in the file's metadata (`aliases`) and
`load_weights` restores them, so `model.load_state_dict(load_weights(path))` works
strictly. A reader that ignores the metadata (the engine) gets one name per tied pair.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from async_rl.utils.weights import as_source
from async_rl.weight_sync.layout import WeightLayout
from async_rl.weight_sync.staging import StagedFile

WRITE_BYTES = 64 << 20  # the publisher writes a version in pieces of this size (views of the model: no copy)

logger = logging.getLogger(__name__)

_NAME = re.compile(r"^weights_v(\d+)\.safetensors$")


def weights_filename(version: int) -> str:
    return f"weights_v{version:06d}.safetensors"


def stale_files(directory: Path, version: int, keep_last: int) -> list[Path]:
    """Weight files more than `keep_last` versions older than `version`, oldest first."""
    found = [(int(m.group(1)), f) for f in directory.iterdir() if (m := _NAME.match(f.name))]
    return [f for v, f in sorted(found) if v <= version - keep_last]


def superseded(path: str | Path, version: int) -> bool:
    """Whether the file of `version` is gone because a newer version replaced it. A file goes only
    for a newer version: pruned once that one is complete, or taken over (renamed to the newer
    one's `.partial`) while it is written, so a newer file, whole or partial, is beside it. A path
    that is gone with nothing newer beside it (a directory this process does not see, a wrong path)
    is not superseded, it is missing."""
    p = Path(path)
    if p.exists() or not p.parent.is_dir():
        return False
    return any((m := _NAME.match(f.name.removeprefix(".").removesuffix(".partial"))) and int(m.group(1)) > version
               for f in p.parent.iterdir())


def prune(directory: Path, version: int, keep_last: int) -> None:
    """Remove weight files more than `keep_last` versions older than `version`."""
    for f in stale_files(directory, version, keep_last):
        f.unlink(missing_ok=True)


def check_keep_last(keep_last: int) -> int:
    if keep_last < 1:
        raise ValueError(f"weight_sync.keep_last: must be >= 1, got {keep_last}")
    return keep_last


class DiskWeightPublisher:
    """Writes one file per version atomically into `dir` and keeps the newest `keep_last` versions."""

    def __init__(self, dir: str | Path, keep_last: int = 2, dtype: torch.dtype | None = None):
        self.dir = Path(dir).resolve()
        self.dir.mkdir(parents=True, exist_ok=True)
        self.keep_last = check_keep_last(keep_last)
        self.dtype = dtype  # floating tensors are written in this dtype (the engine's); None: as the model holds them

    def path_for(self, version: int) -> Path:
        return self.dir / weights_filename(version)

    def publish(self, weights: Any, version: int) -> dict[str, Any]:
        """Write `weights` (a `WeightSource`, read tensor by tensor, or a state dict) as version `version`;
        return the message telling readers where it is."""
        if not isinstance(version, int) or version < 0:
            raise ValueError(f"version: must be an integer >= 0, got {version!r}")
        source = as_source(weights)
        try:
            layout, tensors = WeightLayout.from_source(source, self.dtype, version=version, bucket_bytes=WRITE_BYTES)
            stale = stale_files(self.dir, version, self.keep_last)
            stage = StagedFile(self.path_for(version), layout, reuse=stale[0] if stale else None)
            try:
                for index, (start, end) in enumerate(layout.buckets):
                    stage.write(index, layout.read(tensors, start, end))
            except BaseException:
                stage.abandon()
                raise
        finally:
            source.close()
        out = stage.finish()
        prune(self.dir, version, self.keep_last)
        logger.debug("published weights v%d to %s", version, out)
        return {"kind": "weights", "version": version, "path": str(out)}


def load_weights(path: str | Path) -> dict[str, torch.Tensor]:
    """A full state_dict from a published file, tied names restored (sharing one tensor)."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"weights file {str(p)!r} does not exist (pruned by keep_last, or never written?)")
    state = load_file(str(p))
    with safe_open(str(p), framework="pt") as fh:
        meta = fh.metadata() or {}
    for alias, name in json.loads(meta.get("aliases", "{}")).items():
        state[alias] = state[name]
    return state


def weights_version(path: str | Path) -> int:
    """The policy version recorded in a published file."""
    with safe_open(str(path), framework="pt") as fh:
        meta = fh.metadata() or {}
    if "policy_version" not in meta:
        raise ValueError(f"{path}: no policy_version in its metadata (not written by DiskWeightPublisher)")
    return int(meta["policy_version"])

