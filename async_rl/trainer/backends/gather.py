"""Full tensors from FSDP2 shards, gathered to rank 0 one tensor at a time (on CPU for checkpoints,
on the device for a publish, `gathered_weights`).

FSDP2 shards a parameter on dim 0 the way `torch.chunk` splits it: rank r holds rows
[r*c, min((r+1)*c, n)) with c = ceil(n / world_size), possibly none. Each rank pads its
rows to c and `dist.gather` brings the pieces to rank 0, which cuts the padding off and
copies the result to CPU. So rank 0 holds at most one full tensor on the device at a
time, the other ranks never hold one, and the full model exists once, on rank 0's CPU.
"""

from __future__ import annotations

import math
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from async_rl.utils.weights import WeightSource


def gather_full(t: torch.Tensor, cpu: bool = True) -> torch.Tensor | None:
    """Collective: the whole of `t` as a detached tensor on rank 0 (a CPU copy, or with `cpu=False` on
    the device), None elsewhere.

    A plain tensor (a buffer FSDP leaves replicated) is copied on rank 0 without communication.
    """
    rank = dist.get_rank()
    if not isinstance(t, DTensor):
        return (t.detach().to("cpu", copy=True) if cpu else t.detach()) if rank == 0 else None
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
    full = torch.cat(parts)[:n]
    del parts
    return full.to("cpu", copy=True) if cpu else full


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


def gathered_weights(module: torch.nn.Module, store: Any, tag: str, wait_s: float = 3600.0) -> WeightSource:
    """Collective: `module.state_dict()` as a lazy `WeightSource`. Rank 0 gathers each distinct tensor
    onto its device when the publisher first reads it (so a publish holds one full tensor, never the
    model); every other rank gathers every tensor in the same order when drained (`.close()`).

    Before each gather rank 0 sets `{tag}/{i}` in the ranks' store and the others wait for it there, not
    in the collective: a publish may spend up to weight_sync.deadline_s on one bucket, longer than a
    collective's timeout, and the other ranks must not time out meanwhile."""
    tensors: dict[int, tuple[str, torch.Tensor]] = {}
    aliases: dict[str, str] = {}
    for name, t in module.state_dict(keep_vars=True).items():
        if id(t) in tensors:
            aliases[name] = tensors[id(t)][0]
        else:
            tensors[id(t)] = (name, t)
    ordered = list(tensors.values())
    rank = dist.get_rank()

    def fetch(i: int) -> torch.Tensor | None:
        key = f"{tag}/{i}"
        if rank == 0:
            store.set(key, b"1")
        else:
            store.wait([key], timedelta(seconds=wait_s))
        return gather_full(ordered[i][1], cpu=False)

    return WeightSource([n for n, _ in ordered], [t.dtype for _, t in ordered], [tuple(t.shape) for _, t in ordered],
                        fetch, aliases, lazy=True)


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
