"""Count the torch calls that read a tensor's values back to the host (on a GPU: a device sync).

    with HostReads() as reads:
        trainer.train_step(groups)
    reads.total, reads.counts   # 12, Counter({"nonzero": 4, "__bool__": 4, ...})

`.item()`, `float(t)`, `if t:`, `.tolist()`, `.nonzero()` and indexing by a boolean mask all make
the host wait for the device to finish everything queued before it. On the CPU they cost nothing,
so a CPU run counts them instead of timing them: the same code on a GPU syncs exactly there (save
for the tensors that stay on the CPU there too, such as an optimizer's step counters).
"""

from __future__ import annotations

import collections

import torch
from torch.overrides import TorchFunctionMode

# tensor methods and functions whose result needs the values on the host
READS = frozenset({"item", "tolist", "__bool__", "__float__", "__int__", "__index__", "nonzero", "masked_select",
                   "unique", "cpu", "numpy"})


def _bool_index(args: tuple) -> bool:
    if len(args) < 2:
        return False
    index = args[1] if isinstance(args[1], tuple) else (args[1],)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in index)


class HostReads(TorchFunctionMode):
    """A torch function mode counting host reads by name (`bool_index` for boolean-mask indexing)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in READS:
            self.counts[name] += 1
        elif name in ("__getitem__", "__setitem__") and _bool_index(args):
            self.counts["bool_index"] += 1
        return func(*args, **(kwargs or {}))
