"""A checkpoint of full tensors read back into FSDP2 shards: each rank keeps only its own rows.

    meta = load_sharded(path, model, optimizer)    # every rank, no communication

The inverse of gather.py. A checkpoint holds full tensors (`model.safetensors`,
`optimizer.pt`, written by rank 0 from gathered shards, or by the single backend). Each
rank opens the files itself and copies the dim-0 rows it owns into its shard: FSDP2 splits
a tensor like `torch.chunk`, so rank r holds rows [r*c, min((r+1)*c, n)) with
c = ceil(n / world_size), possibly none. safetensors reads only those rows and
`optimizer.pt` is memory-mapped, so no rank holds the whole model.

So every rank must see the checkpoint directory: one machine, or `run_dir` on a file system
all trainer ranks share (as a Ray run across machines already asks). Tensors FSDP leaves
whole (replicated buffers, Adam's scalar `step`) are read whole on every rank.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch.distributed.tensor import DTensor, Shard


def shard_rows(n: int, rank: int, world_size: int) -> slice:
    """The dim-0 rows of an n-row tensor that `rank` holds under FSDP2 (torch.chunk's split)."""
    chunk = math.ceil(n / world_size) if n else 0
    start = min(rank * chunk, n)
    return slice(start, min(start + chunk, n))


def _rows_of(t: torch.Tensor) -> slice | None:
    """This rank's rows of `t` when it is a dim-0 shard (a DTensor), None when it is whole here."""
    if not isinstance(t, DTensor):
        return None
    if tuple(t.placements) != (Shard(0),):
        raise ValueError(f"load_sharded: expected a tensor sharded on dim 0, got placements {t.placements}")
    mesh = t.device_mesh
    rows = shard_rows(t.shape[0], mesh.get_local_rank(), mesh.size())
    local = t.to_local()
    if local.shape[0] != rows.stop - rows.start:
        raise ValueError(f"load_sharded: this rank holds {local.shape[0]} rows of a {tuple(t.shape)} tensor, "
                         f"expected rows {rows.start}:{rows.stop} (not an FSDP2 chunk split)")
    return rows


def read_meta(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    if not (p / "meta.json").is_file():
        raise FileNotFoundError(f"{p}: not a checkpoint directory (no meta.json)")
    return json.loads((p / "meta.json").read_text())


def load_sharded_model(module: torch.nn.Module, file: str | Path) -> None:
    """Copy this rank's rows of every tensor of `module.state_dict()` from a safetensors file.

    A tensor under several names (tied embedding and LM head) is stored once, under any one of them.
    """
    entries = module.state_dict(keep_vars=True)
    names: dict[int, list[str]] = {}
    for name, t in entries.items():
        names.setdefault(id(t), []).append(name)
    with safe_open(str(file), framework="pt", device="cpu") as f:
        stored = set(f.keys())
        used: set[str] = set()
        for aliases in names.values():
            target = entries[aliases[0]]
            found = [n for n in aliases if n in stored]
            if not found:
                raise ValueError(f"{file}: has no tensor {' or '.join(aliases)} (a checkpoint of another model?)")
            used.update(found)
            piece = f.get_slice(found[0])
            if tuple(piece.get_shape()) != tuple(target.shape):
                raise ValueError(f"{file}: {found[0]} has shape {tuple(piece.get_shape())}, the model's is "
                                 f"{tuple(target.shape)} (a checkpoint of another model?)")
            rows = _rows_of(target)
            local = target.to_local() if rows is not None else target
            with torch.no_grad():
                local.copy_(f.get_tensor(found[0]) if rows is None else piece[rows])
        if unknown := sorted(stored - used):
            raise ValueError(f"{file}: tensors the model does not have: {', '.join(unknown[:5])}"
                             f"{' ...' if len(unknown) > 5 else ''} (a checkpoint of another model?)")


def _shard_like(value: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """An optimizer state tensor of `param`'s shape, cut to this rank's shard as `param` is."""
    rows = _rows_of(param)
    if rows is None or value.dim() == 0:  # whole here, or a scalar such as Adam's step
        return value.clone()
    if tuple(value.shape) != tuple(param.shape):
        raise ValueError(f"optimizer.pt: a state tensor of shape {tuple(value.shape)} for a parameter of shape "
                         f"{tuple(param.shape)} (a checkpoint of another model?)")
    local = value[rows].to(param.device, copy=True)
    return DTensor.from_local(local, param.device_mesh, param.placements, run_check=False,
                              shape=param.shape, stride=param.stride())


def load_sharded_optimizer(optimizer: torch.optim.Optimizer, file: str | Path) -> None:
    """Load a full `optimizer.state_dict()` (index-keyed, as torch saves it) into an optimizer over
    sharded parameters: every state tensor shaped like its parameter keeps this rank's rows."""
    full = torch.load(file, weights_only=True, mmap=True, map_location="cpu")
    params = [p for group in optimizer.param_groups for p in group["params"]]
    saved = [idx for group in full["param_groups"] for idx in group["params"]]
    if len(saved) != len(params):
        raise ValueError(f"{file}: optimizer state of {len(saved)} parameters, this model trains {len(params)}")
    param_of = dict(zip(saved, params))  # load_state_dict pairs them in this order too
    state = {}
    for idx, entry in full["state"].items():
        state[idx] = {k: _shard_like(v, param_of[idx]) if isinstance(v, torch.Tensor) else v
                      for k, v in entry.items()}
    optimizer.load_state_dict({"state": state, "param_groups": full["param_groups"]})


def load_sharded(path: str | Path, module: torch.nn.Module,
                 optimizer: torch.optim.Optimizer | None = None) -> dict[str, Any]:
    """This rank's shard of a checkpoint's weights (and optimizer state, when given); returns its meta."""
    p = Path(path)
    meta = read_meta(p)
    load_sharded_model(module, p / "model.safetensors")
    if optimizer is not None:
        if not (p / "optimizer.pt").is_file():
            raise FileNotFoundError(f"{p}: has no optimizer.pt (saved without an optimizer state)")
        load_sharded_optimizer(optimizer, p / "optimizer.pt")
    return meta
