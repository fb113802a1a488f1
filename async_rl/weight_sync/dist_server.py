"""The `dist` transport, server side: a generation server's weight groups and what it receives over them.

    groups = DistWeightGroups(device)
    groups.init(master_address, master_port, rank, world_size, group_name, backend, timeout_s)
    tensors = groups.receive(group_name, names, dtypes, shapes, load_format)   # [(name, tensor on device)]

`receive` takes exactly what SGLang 0.5.23 takes for one `/update_weights_from_distributed`
request (`srt/model_executor/model_runner_components/weight_updater.py`,
`receive_weights_from_distributed`): with `load_format="flattened_bucket"` ONE broadcast of a
uint8 tensor holding every named tensor, dtype-aligned (`flat_bucket.unpack`); with `None`
one broadcast per named tensor, in order. The tensors arrive on the engine's device (a GPU
engine receives on the GPU and copies into its parameters: no host, no file), one
request's worth at a time. A failed receive aborts the group (the trainer aborts its side).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from async_rl.weight_sync import flat_bucket, group
from async_rl.weight_sync.layout import DTYPES, dtype_name
from async_rl.weight_sync.staging import WeightSyncError


class DistWeightGroups:
    """A generation server's groups by name; tensors are received on `device`."""

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self.groups: dict[str, tuple[Any, float]] = {}  # name -> (group, timeout_s)
        group.close_at_exit(self.close)

    def init(self, master_address: str, master_port: int, rank: int, world_size: int, group_name: str,
             backend: str, timeout_s: float) -> None:
        """Join a group (blocking until it forms, at most `timeout_s`); replaces one of the same name."""
        self.destroy(group_name)
        self.groups[group_name] = (group.join_group(backend, master_address, master_port, group_name, rank,
                                                    world_size, timeout_s), timeout_s)

    def destroy(self, group_name: str, failed: bool = False) -> bool:
        found = self.groups.pop(group_name, None)
        if found is not None:
            group.close(found[0], failed=failed)
        return found is not None

    def close(self) -> None:
        """Destroy every group (and drop it)."""
        for name in list(self.groups):
            self.destroy(name)

    def receive(self, group_name: str, names: list[str], dtypes: list[str], shapes: list[list[int]],
                load_format: str | None) -> list[tuple[str, torch.Tensor]]:
        """One request's tensors, received on the device; WeightSyncError (and the group aborted) on failure."""
        if group_name not in self.groups:
            raise WeightSyncError(f"group_name: {group_name!r} is not initialised on this server "
                                  "(call /init_weights_update_group first)")
        pg, timeout_s = self.groups[group_name]
        deadline = time.monotonic() + timeout_s
        try:
            if load_format == "flattened_bucket":
                _, total = flat_bucket.offsets(dtypes, shapes)
                flat = torch.empty(total, dtype=torch.uint8, device=self.device)
                group.broadcast(pg, flat, f"weights bucket of {len(names)} tensors", timeout_s, deadline)
                return list(flat_bucket.unpack(flat, names, dtypes, shapes))
            out = []
            for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
                t = torch.empty(shape, dtype=DTYPES[dtype_name(dtype)][1], device=self.device)
                group.broadcast(pg, t, f"weights tensor {name}", timeout_s, deadline)
                out.append((name, t))
            return out
        except BaseException:
            self.destroy(group_name, failed=True)
            raise
