"""The trainer's batching rule: which buffered groups make the next batch (pure, no I/O).

The trainer's queue (`queue.TrajectoryQueueServer.get_groups`) and the simulator (`async_rl/sim`)
call the same function, so a simulated run batches as a real one does.
"""

from __future__ import annotations

from collections import deque


def take_groups(buffer: deque, num_trajectories: int) -> list:
    """The trainer's batch: whole groups from `buffer` until they total >= num_trajectories (the caller
    checked that many are buffered), the oldest first: by the oldest policy version any of a group's
    tokens came from, ties in arrival order. A group that finished late (long answers) would otherwise
    wait behind younger ones that arrived before it, and go over the staleness bound while it waits.
    The rest stay in arrival order. Pure, so the simulator (`async_rl/sim`) batches by the same rule."""
    ages = [min(t.oldest_version() for t in group) for group in buffer]
    order = sorted(range(len(ages)), key=ages.__getitem__)  # stable: arrival order among equals
    picked, taken = [], 0
    for i in order:
        if taken >= num_trajectories:
            break
        picked.append(i)
        taken += len(buffer[i])
    groups = [buffer[i] for i in picked]
    chosen = set(picked)
    rest = [g for i, g in enumerate(buffer) if i not in chosen]
    buffer.clear()
    buffer.extend(rest)
    return groups
