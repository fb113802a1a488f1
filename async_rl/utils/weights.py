"""The weights of one publish, read tensor by tensor from the live model: no copy of the whole model.

The trainer makes it (`trainer.weights()`), a weight transport reads it (`async_rl.weight_sync`).

    source = trainer.weights()                       # views of the parameters (FSDP: gathered lazily)
    publisher.publish(source, version)               # reads each tensor once, in order, in its wire dtype

A publisher lays the version out from `specs(dtype)` and reads each tensor with
`get(name)` (as the model holds it) or `wire(name, dtype)` (converted to the dtype on
the wire: the engine's, so a bf16 engine gets half the bytes of the fp32 master weights).
Reads go in layout order; the source keeps only the tensor read last (a tensor that spans
two buckets is read twice), so a publish holds at most one converted tensor besides what
the transport itself buffers (one bucket). Tensors that are one tensor in the model (a
tied embedding and LM head) are listed once, the other names as `aliases`.

A plain state dict is a source too (`as_source`): tests and the benchmark publish dicts.
`FSDP` sources gather each tensor from its shards when it is first read; `close()` gathers
whatever the publisher did not read (it failed midway), so the other ranks, which gather
every tensor in order (`drain`), are never left waiting.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch



def unique_tensors(state_dict: Mapping[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """({name: tensor} without repeats, {dropped name: kept name}) for tensors that are one tensor (tied)."""
    kept: dict[tuple, str] = {}
    tensors: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    for name, t in state_dict.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"state_dict[{name!r}]: expected a tensor, got {type(t).__name__}")
        t = t.detach()
        key = (t.device, t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype)
        if t.numel() and key in kept:
            aliases[name] = kept[key]
            continue
        kept[key] = name
        tensors[name] = t
    return tensors, aliases


class WeightSource:
    """Distinct tensors by name (in order), read through `fetch(index)` one at a time."""

    def __init__(self, names: list[str], dtypes: list[torch.dtype], shapes: list[tuple[int, ...]],
                 fetch: Callable[[int], torch.Tensor | None], aliases: Mapping[str, str] | None = None,
                 lazy: bool = False):
        self.names, self.dtypes, self.shapes = names, dtypes, shapes
        self.aliases = dict(aliases or {})
        self._fetch = fetch
        self._lazy = lazy  # fetch is a collective: every index is fetched exactly once, in order
        self._index = {n: i for i, n in enumerate(names)}
        self._next = 0
        self._last: tuple[int, torch.Tensor | None] | None = None
        self._wire: tuple[int, torch.dtype, torch.Tensor] | None = None

    @classmethod
    def from_state_dict(cls, state_dict: Mapping[str, Any]) -> "WeightSource":
        tensors, aliases = unique_tensors(state_dict)
        views = list(tensors.values())
        return cls(list(tensors), [t.dtype for t in views], [tuple(t.shape) for t in views],
                   views.__getitem__, aliases)

    def specs(self, dtype: torch.dtype | None = None) -> tuple[list[str], list[str], list[list[int]]]:
        """SGLang's names / dtypes / shapes, with floating tensors in `dtype` when one is given."""
        return (list(self.names), [str(self._cast(d, dtype)).removeprefix("torch.") for d in self.dtypes],
                [list(s) for s in self.shapes])

    @staticmethod
    def _cast(d: torch.dtype, dtype: torch.dtype | None) -> torch.dtype:
        return dtype if dtype is not None and d.is_floating_point else d

    def get(self, name: str) -> torch.Tensor:
        """The tensor as the model holds it (a view where it can be)."""
        i = self._index[name]
        if self._last is not None and self._last[0] == i:
            return self._last[1]
        if not self._lazy:
            self._last = (i, self._fetch(i))
            return self._last[1]
        if i < self._next:
            raise RuntimeError(f"weights: {name!r} read again after a later tensor (a lazy source reads in order)")
        while self._next <= i:  # a collective per tensor: the other ranks gather every one, in order
            t = self._fetch(self._next)
            self._last = None  # drop the previous tensor before holding the next
            self._last = (self._next, t)
            self._next += 1
        return self._last[1]

    def wire(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The tensor in the dtype on the wire (floating tensors only are converted), contiguous."""
        t = self.get(name)
        want = self._cast(t.dtype, dtype)
        if want == t.dtype:
            return t.contiguous()
        i = self._index[name]
        if self._wire is None or self._wire[:2] != (i, want):
            self._wire = None
            self._wire = (i, want, t.to(want))
        return self._wire[2]

    def wire_view(self, dtype: torch.dtype | None = None) -> Mapping[str, torch.Tensor]:
        """`{name: tensor}` in the wire dtype, read on access (what `WeightLayout.read` takes)."""
        return _WireView(self, dtype)

    def close(self) -> None:
        """Read what was not read (a lazy source: the other ranks gather everything) and let go of it all."""
        if self._lazy:
            while self._next < len(self.names):
                self._fetch(self._next)
                self._next += 1
        self._last = self._wire = None


class _WireView(Mapping):
    def __init__(self, source: WeightSource, dtype: torch.dtype | None):
        self.source, self.dtype = source, dtype

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.source.wire(name, self.dtype)

    def __iter__(self):
        return iter(self.source.names)

    def __len__(self) -> int:
        return len(self.source.names)


def as_source(weights: Any) -> WeightSource:
    """A `WeightSource` as it is, a state dict wrapped (its tensors are read as they are)."""
    return weights if isinstance(weights, WeightSource) else WeightSource.from_state_dict(weights)
