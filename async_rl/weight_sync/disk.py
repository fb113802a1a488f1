"""The `disk` weight transport: the trainer writes each version's directory and only its path travels.

The trainer writes version N as `weights/vNNNNNN/model.safetensors` and the rollout side
(which shares its file system) loads that directory into each server: SGLang's
`/update_weights_from_disk` takes a directory and loads every `*.safetensors` in it
(`versions.py` says where that is read). The streaming transports (`zmq_buckets.py`,
`dist_*.py`) stream the same tensors; zmq stages files of this format on the receiving side.

A version is written into a hidden `.vNNNNNN.partial` directory and renamed, so a reader
never sees half a version: the publisher lays a version out as the streaming transports do
(`layout.py`) and writes the model's tensors straight into a `versions.StagedVersion`,
taking over the file of the version it is about to prune when nobody is reading it (no
serialised copy, no fresh page cache). Only the embedded engine holds the read lock that makes
this safe; SGLang maps the files without it, so with SGLang servers (`take_over=False`) every
version gets a fresh file. Tensors that are one tensor in the model (a tied
embedding and LM head) are stored once; the other names are recorded in the file's metadata
(`aliases`) and `load_weights` restores them, so `model.load_state_dict(load_weights(path))`
works strictly. A reader that ignores the metadata (the engine, SGLang) gets one name per
tied pair.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from async_rl.utils.weights import as_source
from async_rl.weight_sync.layout import WeightLayout
from async_rl.weight_sync.versions import WEIGHTS_FILE, StagedVersion, check_keep_last, prune, stale_dirs, version_dir

WRITE_BYTES = 64 << 20  # the publisher writes a version in pieces of this size (views of the model: no copy)

logger = logging.getLogger(__name__)


class DiskWeightPublisher:
    """Writes one directory per version atomically into `dir` and keeps the newest `keep_last` versions."""

    def __init__(self, dir: str | Path, keep_last: int = 2, dtype: torch.dtype | None = None,
                 take_over: bool = True):
        self.dir = Path(dir).resolve()
        self.dir.mkdir(parents=True, exist_ok=True)
        self.keep_last = check_keep_last(keep_last)
        self.dtype = dtype  # floating tensors are written in this dtype (the engine's); None: as the model holds them
        self.take_over = take_over  # False where a reader may not lock what it loads (SGLang)

    def path_for(self, version: int) -> Path:
        return version_dir(self.dir, version)

    def publish(self, weights: Any, version: int) -> dict[str, Any]:
        """Write `weights` (a `WeightSource`, read tensor by tensor, or a state dict) as version `version`;
        return the message telling readers where it is."""
        if not isinstance(version, int) or version < 0:
            raise ValueError(f"version: must be an integer >= 0, got {version!r}")
        source = as_source(weights)
        try:
            layout, tensors = WeightLayout.from_source(source, self.dtype, version=version, bucket_bytes=WRITE_BYTES)
            stale = stale_dirs(self.dir, version, self.keep_last)
            stage = StagedVersion(self.dir, layout, reuse=stale[0] if stale and self.take_over else None)
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


def _weights_file(path: str | Path) -> Path:
    """The weights file of a version directory (or the file itself)."""
    p = Path(path)
    return p / WEIGHTS_FILE if p.is_dir() else p


def load_weights(path: str | Path) -> dict[str, torch.Tensor]:
    """A full state_dict from a published version (its directory, or its weights file), tied names restored
    (sharing one tensor)."""
    p = _weights_file(path)
    if not p.is_file():
        raise FileNotFoundError(f"weights {str(path)!r} do not exist (pruned by keep_last, or never written?)")
    state = load_file(str(p))
    with safe_open(str(p), framework="pt") as fh:
        meta = fh.metadata() or {}
    for alias, name in json.loads(meta.get("aliases", "{}")).items():
        state[alias] = state[name]
    return state


def weights_version(path: str | Path) -> int:
    """The policy version recorded in a published version (its directory, or its weights file)."""
    with safe_open(str(_weights_file(path)), framework="pt") as fh:
        meta = fh.metadata() or {}
    if "policy_version" not in meta:
        raise ValueError(f"{path}: no policy_version in its metadata (not written by DiskWeightPublisher)")
    return int(meta["policy_version"])
