"""Dynamic sampling (DAPO): a train batch holds only groups whose rewards differ.

A group whose samples all got the same reward (all solved, all failed) has zero group-relative
advantage: it adds no gradient, only tokens to the denominator, so as a task gets easy or hard
the effective batch shrinks. With `trainer.dynamic_sampling` the trainer sets such groups aside
and takes more from the queue until B trajectories with signal are in hand:

    batch = fill_batch(take, batch_size, on_filtered)

`take(n)` returns whole groups totalling at least n trajectories (it blocks until they arrive).
`on_filtered(groups)` is called for each set of groups set aside, before more are taken: the
caller records them as consumed (ledger event `filtered`, their prompts used up) and releases
them from the rollout side's staleness count, so the gate, which admits at most (v + eta + 1) * B
trajectories, admits as many replacements. Without that release a filtered group would hold
its place in the bound for ever and admission would stall.

Why in the trainer and not in the rollout controller: the trainer's consumption is what
checkpoints commit and what a restarted side is told (which prompts are used up), so a
filtered group follows the same exactly-once path as a trained or over-stale one; the cost is
sending those groups over the queue.
"""

from __future__ import annotations

from collections.abc import Callable

from async_rl.trainer.advantages import no_signal
from async_rl.types import Trajectory

Group = list[Trajectory]


def split_by_signal(groups: list[Group]) -> tuple[list[Group], list[Group]]:
    """(groups whose rewards differ, groups whose rewards are all equal)."""
    kept, flat = [], []
    for g in groups:
        (flat if no_signal([t.reward for t in g]) else kept).append(g)
    return kept, flat


def fill_batch(take: Callable[[int], list[Group]], batch_size: int,
               on_filtered: Callable[[list[Group]], None]) -> list[Group]:
    """Groups with signal totalling at least `batch_size` trajectories (see the module docstring)."""
    kept: list[Group] = []
    have = 0
    while have < batch_size:
        signal, flat = split_by_signal(take(batch_size - have))
        if flat:
            on_filtered(flat)
        kept += signal
        have += sum(len(g) for g in signal)
    return kept
