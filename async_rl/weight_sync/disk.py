"""The `disk` weight transport: the trainer writes safetensors files and only the path travels.

The trainer writes `weights_v{version:06d}.safetensors` and the rollout side (which shares
its file system) loads that path into each server. The streaming transports (`zmq.py`,
`dist.py`) stage files of the same format on the receiving side.

Files are written under a temporary name and renamed, so a reader never sees half a
file. Tensors that are one tensor in the model (a tied embedding and LM head) are
stored once; the other names are recorded in the file's metadata (`aliases`) and
`load_weights` restores them, so `model.load_state_dict(load_weights(path))` works
strictly. A reader that ignores the metadata (the engine) gets one name per tied pair.
"""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from async_rl.weight_sync.layout import unique_tensors

logger = logging.getLogger(__name__)

_NAME = re.compile(r"^weights_v(\d+)\.safetensors$")


def weights_filename(version: int) -> str:
    return f"weights_v{version:06d}.safetensors"


def _dedup(state_dict: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(CPU contiguous tensors sharing no storage, {dropped name: kept name} for identical tensors)."""
    tensors, aliases = unique_tensors(state_dict)
    seen: set[int] = set()
    for name, t in tensors.items():
        t = t.to("cpu")
        storage = t.untyped_storage()
        whole = t.is_contiguous() and t.storage_offset() == 0 and storage.nbytes() == t.numel() * t.element_size()
        if not whole or storage.data_ptr() in seen:  # a view of something else: give it its own bytes
            t = t.clone(memory_format=torch.contiguous_format)
        seen.add(storage.data_ptr())
        tensors[name] = t
    return tensors, aliases


def prune(directory: Path, version: int, keep_last: int) -> None:
    """Remove weight files more than `keep_last` versions older than `version`."""
    for f in directory.iterdir():
        m = _NAME.match(f.name)
        if m and int(m.group(1)) <= version - keep_last:
            f.unlink(missing_ok=True)


def check_keep_last(keep_last: int) -> int:
    if keep_last < 1:
        raise ValueError(f"weight_sync.keep_last: must be >= 1, got {keep_last}")
    return keep_last


class DiskWeightPublisher:
    """Writes one file per version atomically into `dir` and keeps the newest `keep_last` versions."""

    def __init__(self, dir: str | Path, keep_last: int = 2):
        self.dir = Path(dir).resolve()
        self.dir.mkdir(parents=True, exist_ok=True)
        self.keep_last = check_keep_last(keep_last)

    def path_for(self, version: int) -> Path:
        return self.dir / weights_filename(version)

    def publish(self, state_dict: dict[str, Any], version: int) -> dict[str, Any]:
        """Write `state_dict` as version `version`; return the message telling readers where it is."""
        if not isinstance(version, int) or version < 0:
            raise ValueError(f"version: must be an integer >= 0, got {version!r}")
        tensors, aliases = _dedup(state_dict)
        out = self.path_for(version)
        tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
        save_file(tensors, str(tmp), metadata={"policy_version": str(version), "aliases": json.dumps(aliases)})
        os.replace(tmp, out)
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

