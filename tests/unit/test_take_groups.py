"""The trainer's batching rule (`take_groups`): whole groups, the oldest first, the rest in arrival order."""

from collections import deque

import numpy as np

from async_rl.transport.batching import take_groups
from async_rl.types import Trajectory


def _group(name: str, versions: list[int], size: int = 2) -> list[Trajectory]:
    """`size` trajectories whose sampled tokens came from `versions` (the first is the oldest of the group)."""
    r = len(versions)
    return [Trajectory(id=f"{name}{k}", group_id=name, prompt_ids=np.zeros(2, np.int32),
                       response_ids=np.ones(r, np.int32), loss_mask=np.ones(r, np.uint8),
                       behav_logprobs=np.zeros(r, np.float32),
                       versions=np.array(versions if k == 0 else [max(versions)] * r, np.int32),
                       reward=0.0, finish_reason="stop") for k in range(size)]


def _names(groups) -> list[str]:
    return [g[0].group_id for g in groups]


def test_the_oldest_groups_go_first_and_the_rest_keep_arrival_order():
    # arrival order: three young groups, then one that started two versions earlier (its long answer
    # finished last) and one whose tokens span versions 1..3 (interrupted by an update: its oldest counts)
    buffer = deque([_group("a", [3]), _group("b", [3]), _group("c", [2]), _group("old", [1, 1]),
                    _group("span", [1, 2, 3])])
    batch = take_groups(buffer, 4)
    assert _names(batch) == ["old", "span"]  # both at version 1: arrival order between them
    assert _names(buffer) == ["a", "b", "c"]
    assert _names(take_groups(buffer, 3)) == ["c", "a"]  # whole groups until >= 3 trajectories
    assert _names(buffer) == ["b"]


def test_equal_versions_are_taken_in_arrival_order_as_sync_runs_are():
    buffer = deque([_group(n, [0]) for n in "pqrst"])
    assert _names(take_groups(buffer, 6)) == ["p", "q", "r"]
    assert _names(buffer) == ["s", "t"]
