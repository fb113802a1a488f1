"""Publish trainer weights as safetensors files; optionally ship the bytes inside a queue message.

`disk`: the trainer writes `weights_v{version}.safetensors` and only the path travels
(rollout and trainer share a file system). `zmq`: the same file's bytes travel in the
control message and the rollout side writes them into its own directory, so the two
sides need no shared directory.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file


class DiskWeightPublisher:
    """Writes one file per version atomically and keeps the newest `keep_last`."""

    def __init__(self, dir: str | Path, keep_last: int = 2):
        self.dir = Path(dir).resolve()
        self.dir.mkdir(parents=True, exist_ok=True)
        self.keep_last = max(1, keep_last)

    def path_for(self, version: int) -> Path:
        return self.dir / f"weights_v{version:06d}.safetensors"

    def publish(self, state_dict: dict[str, torch.Tensor], version: int) -> dict[str, Any]:
        out = self.path_for(version)
        tmp = out.with_name(out.name + f".tmp{os.getpid()}")
        plain = {k: v.detach().cpu().contiguous().clone() for k, v in state_dict.items()}
        save_file(plain, str(tmp), metadata={"policy_version": str(version)})
        tmp.replace(out)
        for old in sorted(self.dir.glob("weights_v*.safetensors"))[:-self.keep_last]:
            old.unlink(missing_ok=True)
        return {"kind": "weights", "version": version, "path": str(out)}


def load_weights(path: str | Path) -> dict[str, torch.Tensor]:
    return load_file(str(path))


class ZmqWeightPayload:
    """Weights as bytes inside a control message, written back to disk on the receiving side."""

    @staticmethod
    def to_bytes(path: str | Path) -> bytes:
        return Path(path).read_bytes()

    @staticmethod
    def write_received(blob: bytes, dir: str | Path, version: int, keep_last: int = 2) -> Path:
        d = Path(dir)
        d.mkdir(parents=True, exist_ok=True)
        out = d / f"weights_v{version:06d}.safetensors"
        tmp = out.with_name(out.name + f".tmp{os.getpid()}")
        tmp.write_bytes(blob)
        tmp.replace(out)
        for old in sorted(d.glob("weights_v*.safetensors"))[:-max(1, keep_last)]:
            old.unlink(missing_ok=True)
        return out
