"""Trainer checkpoints: model (safetensors), optimizer state, and a JSON of counters; written atomically."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file


def _plain_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    # clone: tied weights share storage, which safetensors refuses to write twice
    return {k: v.detach().cpu().contiguous().clone() for k, v in model.state_dict().items()}


def save_checkpoint(path: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, step: int,
                    extra: dict[str, Any] | None = None) -> Path:
    out = Path(path)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(_plain_state(model), str(tmp / "model.safetensors"))
    if optimizer is not None:
        torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
    (tmp / "meta.json").write_text(json.dumps({"step": step, **(extra or {})}))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def load_checkpoint(path: str | Path, model: torch.nn.Module,
                    optimizer: torch.optim.Optimizer | None = None) -> dict[str, Any]:
    p = Path(path)
    if not (p / "meta.json").is_file():
        raise FileNotFoundError(f"{p}: not a checkpoint (no meta.json)")
    model.load_state_dict(load_file(str(p / "model.safetensors")))
    if optimizer is not None and (p / "optimizer.pt").is_file():
        optimizer.load_state_dict(torch.load(p / "optimizer.pt", weights_only=True))
    return json.loads((p / "meta.json").read_text())


def latest_checkpoint(root: str | Path) -> Path | None:
    found = sorted(d for d in Path(root).glob("step_*") if (d / "meta.json").is_file())
    return found[-1] if found else None
