"""Trainer checkpoints: a directory with the model (safetensors), the optimizer state and a JSON.

    <root>/step_000010/model.safetensors   weights, tied tensors stored once
                      /optimizer.pt        torch.save of optimizer.state_dict() (local use)
                      /meta.json           {"step": 10, **extra}  e.g. extra={"policy_version": 10}
                      /config.json, tokenizer files (with `hf_export`)

A backend that holds its weights in another layout (megatron) passes `TensorStream`s instead
of state dicts: HF-named tensors that arrive one at a time (gathered and converted as they are
written), so the model is never assembled whole; its optimizer state is then
`optimizer.safetensors` (each moment under `exp_avg.<name>`, `exp_avg_sq.<name>`).

With `hf_export` (see `hf_exporter`) the directory is also a plain Hugging Face model:
`AutoModelForCausalLM.from_pretrained(dir)` and `AutoTokenizer.from_pretrained(dir)` load it
as it is (the weights carry the HF model's own names).

A checkpoint is written into a temporary sibling directory and renamed into place, so
a crash leaves either the old checkpoint or the new one, never half of one.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import re
import shutil
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_model, save_file, save_model

logger = logging.getLogger(__name__)

_NAME = re.compile(r"^step_(\d+)$")


@dataclass
class TensorStream:
    """Tensors that come one at a time, in the order of `specs` (name, shape), all of `dtype`."""

    specs: list[tuple[str, tuple[int, ...]]]
    tensors: Iterable[tuple[str, torch.Tensor]]
    dtype: torch.dtype = torch.float32
    metadata: dict[str, str] = field(default_factory=dict)


_ST_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


def write_stream(path: str | Path, stream: TensorStream) -> None:
    """A safetensors file written tensor by tensor: the header first (from the specs), then each tensor's
    bytes as it arrives, checked against its spec. Holds one tensor at a time."""
    head: dict[str, Any] = {"__metadata__": stream.metadata}
    offset, size = 0, stream.dtype.itemsize
    for name, shape in stream.specs:
        n = size * int(torch.Size(shape).numel())
        head[name] = {"dtype": _ST_DTYPES[stream.dtype], "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    text = json.dumps(head, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little") + text)
        count = 0
        for (name, shape), (got, t) in zip(stream.specs, stream.tensors):
            if got != name or tuple(t.shape) != tuple(shape) or t.dtype != stream.dtype:
                raise ValueError(f"{path}: expected {name} {tuple(shape)} {stream.dtype}, "
                                 f"got {got} {tuple(t.shape)} {t.dtype}")
            f.write(t.detach().to("cpu").contiguous().view(-1).view(torch.uint8).numpy().data)
            count += 1
        if count != len(stream.specs):
            raise ValueError(f"{path}: {count} tensors came, {len(stream.specs)} expected")


class HFTensors:
    """name -> tensor of a safetensors file, or of every one in a directory (an HF checkpoint, sharded or
    not), read one tensor at a time; `metadata` is the (first) file's. Use as a context manager."""

    def __init__(self, path: str | Path):
        p = Path(path)
        files = sorted(p.glob("*.safetensors")) if p.is_dir() else [p]
        if not files or not all(f.is_file() for f in files):
            raise FileNotFoundError(f"{p}: no safetensors weights there")
        self._open = [safe_open(str(f), framework="pt", device="cpu") for f in files]
        self._where = {name: f for f in self._open for name in f.keys()}
        self.metadata = self._open[0].metadata() or {}

    def __call__(self, name: str) -> torch.Tensor:
        if name not in self._where:
            raise ValueError(f"has no tensor {name} (a checkpoint of another model?)")
        return self._where[name].get_tensor(name)

    def __enter__(self) -> "HFTensors":
        return self

    def __exit__(self, *exc: Any) -> None:
        self._open.clear()
        self._where.clear()


def checkpoint_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"step_{step:06d}"


def save_checkpoint(path: str | Path, model: torch.nn.Module | Mapping[str, torch.Tensor] | TensorStream,
                    optimizer: torch.optim.Optimizer | Mapping[str, Any] | TensorStream | None, step: int,
                    extra: dict[str, Any] | None = None, hf_export: Callable[[Path], None] | None = None) -> Path:
    """Write a checkpoint directory at `path` (replacing one already there); return its path.

    `model` and `optimizer` may also be state dicts already gathered (a sharded trainer's
    full CPU tensors, tied entries as one tensor); the files are the same either way. Or
    `TensorStream`s, written as they come (see the module docstring).
    """
    extra = dict(extra or {})
    if "step" in extra:
        raise ValueError("extra: 'step' is reserved (pass the step as the `step` argument)")
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f"{out.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    if isinstance(model, TensorStream):
        write_stream(tmp / "model.safetensors", TensorStream(model.specs, model.tensors, model.dtype,
                                                             {**model.metadata, "step": str(step)}))
    elif isinstance(model, torch.nn.Module):
        save_model(model, str(tmp / "model.safetensors"), metadata={"step": str(step)})
    else:  # one name per tensor object: load_model() restores the tied names from the model
        tensors, seen = {}, set()
        for name, t in model.items():
            if id(t) not in seen:
                seen.add(id(t))
                tensors[name] = t.contiguous()
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"step": str(step)})
    if isinstance(optimizer, TensorStream):
        write_stream(tmp / "optimizer.safetensors", optimizer)
    elif optimizer is not None:
        torch.save(optimizer if isinstance(optimizer, Mapping) else optimizer.state_dict(), tmp / "optimizer.pt")
    (tmp / "meta.json").write_text(json.dumps({"step": step, **extra}, indent=1))
    if hf_export is not None:
        hf_export(tmp)
    old = out.with_name(f"{out.name}.old{os.getpid()}")
    if out.exists():
        out.rename(old)
    tmp.rename(out)
    shutil.rmtree(old, ignore_errors=True)
    logger.info("checkpoint of step %d written to %s", step, out)
    return out


def load_checkpoint(path: str | Path, model: torch.nn.Module,
                    optimizer: torch.optim.Optimizer | None = None) -> dict[str, Any]:
    """Load weights (and optimizer state when given and saved) from `path`; return meta.json's dict."""
    p = Path(path)
    if not (p / "meta.json").is_file():
        raise FileNotFoundError(f"{p}: not a checkpoint directory (no meta.json)")
    device = next(model.parameters()).device
    load_model(model, str(p / "model.safetensors"), strict=True, device=str(device))
    if optimizer is not None:
        if not (p / "optimizer.pt").is_file():
            raise FileNotFoundError(f"{p}: has no optimizer.pt (saved without an optimizer); pass optimizer=None")
        optimizer.load_state_dict(torch.load(p / "optimizer.pt", weights_only=True, map_location=device))
    return json.loads((p / "meta.json").read_text())


def complete_checkpoints(root: str | Path) -> list[tuple[int, Path]]:
    """(step, directory) of every complete checkpoint under `root`, oldest first. A directory still being
    written (`step_N.tmpPID`, left half-written by a killed trainer) is not one."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted((int(m.group(1)), d) for d in root.iterdir()
                  if (m := _NAME.match(d.name)) and (d / "meta.json").is_file())


def latest_checkpoint(root: str | Path) -> Path | None:
    """The complete checkpoint with the highest step under `root`, or None."""
    found = complete_checkpoints(root)
    return found[-1][1] if found else None


def hf_exporter(model_config: Any, tokenizer: Any) -> Callable[[Path], None]:
    """Writes what makes a checkpoint directory a Hugging Face model: the model config (fp32, the
    dtype of the saved weights) and the tokenizer."""
    def export(directory: Path) -> None:
        config = copy.deepcopy(model_config)
        # transformers >= 4.56 calls the field `dtype` (and warns on `torch_dtype`); older ones `torch_dtype`
        setattr(config, "dtype" if hasattr(config, "dtype") else "torch_dtype", "float32")
        config.save_pretrained(directory)
        tokenizer.save_pretrained(directory)
    return export


def prune_checkpoints(root: str | Path, keep: int) -> list[Path]:
    """Delete all but the `keep` newest complete checkpoints under `root` (0 = keep all); return what went."""
    if keep <= 0:
        return []
    gone = [d for _, d in complete_checkpoints(root)[:-keep]]
    for d in gone:
        shutil.rmtree(d, ignore_errors=True)
    return gone
