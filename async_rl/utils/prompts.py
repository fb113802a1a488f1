"""Positions in the training prompt stream, as a compact set.

Every training prompt has a position in the task's seeded stream (`prompt_index` in a
trajectory's info: 0, 1, 2, ...). The trainer keeps the set of positions it has consumed
(trained or dropped) in the history of its weights, and tells a rollout side that joins:
the side generates every position from the low-water mark on that the set does not hold,
so no prompt of the stream is skipped when a side dies before delivering what it admitted,
and none is generated twice while the trainer holds it.

    held = PromptSet()
    held.update([0, 1, 2, 5])
    held.low, held.above()          # 3, [5]: all of 0..2, and 5 beyond the first hole
    PromptSet.from_wire(held.to_wire()) == held
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

PROMPT_KEY = "prompt_index"  # the trajectory info key carrying a training prompt's position


def prompt_of(info: dict[str, Any]) -> int | None:
    """The stream position a trajectory's info names, or None (evaluation, hand-made trajectories)."""
    value = info.get(PROMPT_KEY)
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


class PromptSet:
    """A set of non-negative ints stored as a low-water mark (all of 0..low-1) plus the members above it."""

    __slots__ = ("low", "_above")

    def __init__(self, low: int = 0, above: Iterable[int] = ()):
        self.low = int(low)
        self._above: set[int] = set()
        self.update(above)

    def add(self, p: int) -> None:
        if p < self.low:
            return
        self._above.add(p)
        while self.low in self._above:
            self._above.discard(self.low)
            self.low += 1

    def update(self, ps: Iterable[int]) -> None:
        for p in ps:
            self.add(int(p))

    def __contains__(self, p: object) -> bool:
        return isinstance(p, int) and (0 <= p < self.low or p in self._above)

    def __len__(self) -> int:
        return self.low + len(self._above)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PromptSet) and (self.low, self._above) == (other.low, other._above)

    def above(self) -> list[int]:
        return sorted(self._above)

    def copy(self) -> "PromptSet":
        return PromptSet(self.low, self._above)

    def missing(self, start: int = 0) -> Iterator[int]:
        """Positions from `start` on that the set does not hold, in order (an endless stream)."""
        p = max(start, self.low)
        while True:
            if p not in self._above:
                yield p
            p += 1

    def to_wire(self) -> dict[str, Any]:
        return {"low": self.low, "above": self.above()}

    @classmethod
    def from_wire(cls, d: Any) -> "PromptSet":
        if not isinstance(d, dict):
            raise ValueError(f"prompt set: expected a map with 'low' and 'above', got {type(d).__name__}")
        low, above = d.get("low", 0), d.get("above", [])
        if not isinstance(low, int) or low < 0 or not isinstance(above, (list, tuple)) \
                or not all(isinstance(p, int) and p >= 0 for p in above):
            raise ValueError("prompt set: 'low' must be an int >= 0 and 'above' a list of ints >= 0")
        return cls(low, above)

    def __repr__(self) -> str:
        return f"PromptSet(low={self.low}, above={self.above()})"


def held_positions(consumed: PromptSet, buffered_groups: Iterable[list], handed: Iterable[int | None]) -> PromptSet:
    """Positions consumed, buffered (groups of trajectories) or being trained (`handed`): what a
    joining producer must not generate again."""
    held = consumed.copy()
    held.update(q for g in buffered_groups for t in g if (q := prompt_of(t.info)) is not None)
    held.update(q for q in handed if q is not None)
    return held
