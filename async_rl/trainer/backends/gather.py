"""Full tensors from FSDP2 shards, gathered to rank 0 one tensor at a time, on CPU.

FSDP2 shards a parameter on dim 0 the way `torch.chunk` splits it: rank r holds rows
[r*c, min((r+1)*c, n)) with c = ceil(n / world_size), possibly none. Each rank pads its
rows to c and `dist.gather` brings the pieces to rank 0, which cuts the padding off and
copies the result to CPU. So rank 0 holds at most one full tensor on the device at a
time, the other ranks never hold one, and the full model exists once, on rank 0's CPU.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard


def gather_full(t: torch.Tensor) -> torch.Tensor | None:
    """Collective: the whole of `t` as a detached CPU tensor on rank 0, None elsewhere.

    A plain tensor (a buffer FSDP leaves replicated) is copied on rank 0 without communication.
    """
    rank = dist.get_rank()
    if not isinstance(t, DTensor):
        return t.detach().to("cpu", copy=True) if rank == 0 else None
    if tuple(t.placements) != (Shard(0),):
        raise ValueError(f"gather_full: expected a tensor sharded on dim 0, got placements {t.placements}")
    world = dist.get_world_size()
    n, rest = t.shape[0], tuple(t.shape[1:])
    chunk = math.ceil(n / world)
    local = t.to_local().detach()
    piece = local.new_zeros((chunk, *rest))
    piece[:local.shape[0]] = local
    if rank != 0:
        dist.gather(piece, None, dst=0)
        return None
    parts = [torch.empty_like(piece) for _ in range(world)]
    dist.gather(piece, parts, dst=0)
    full = torch.cat(parts)[:n].to("cpu", copy=True)
    del parts
    return full


def gather_state_dict(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Collective: `module.state_dict()` as full CPU tensors on rank 0 ({} elsewhere).

    Tied entries (one parameter under two names) are gathered once and stay one tensor.
    """
    done: dict[int, torch.Tensor | None] = {}
    out: dict[str, torch.Tensor] = {}
    for name, t in module.state_dict(keep_vars=True).items():
        if id(t) not in done:
            done[id(t)] = gather_full(t)
        if done[id(t)] is not None:
            out[name] = done[id(t)]
    return out


def gather_optimizer_state(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Collective: `optimizer.state_dict()` with every sharded state tensor made whole, on rank 0.

    The result loads into the same optimizer over an unsharded copy of the model.
    """
    sd = optimizer.state_dict()
    state: dict[Any, dict[str, Any]] = {}
    for idx in sorted(sd["state"]):
        entry = {}
        for key, value in sd["state"][idx].items():
            entry[key] = gather_full(value) if isinstance(value, torch.Tensor) else value
        state[idx] = entry
    return {"state": state, "param_groups": sd["param_groups"]} if dist.get_rank() == 0 else {}
