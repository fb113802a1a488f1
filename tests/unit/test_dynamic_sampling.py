"""Dynamic sampling: groups without reward variance are set aside and replaced, and the staleness
gate, told of each set-aside group, admits the replacements (and would stall if it were not told)."""

from collections import deque

import numpy as np
import pytest

from async_rl.rollout.staleness import StalenessGate
from async_rl.trainer.dynamic_sampling import fill_batch, split_by_signal
from async_rl.types import Trajectory

N = 4  # samples per prompt


def _group(k: int, rewards: list[float]) -> list[Trajectory]:
    return [Trajectory(id=f"g{k}-{i}", group_id=f"g{k}", prompt_ids=np.array([1], np.int32),
                       response_ids=np.array([2], np.int32), loss_mask=np.ones(1, np.uint8),
                       behav_logprobs=np.zeros(1, np.float32), versions=np.zeros(1, np.int32), reward=r,
                       finish_reason="stop") for i, r in enumerate(rewards)]


class _Rollout:
    """The rollout side in miniature: admits a group whenever the gate allows, generates it at once
    with the next scripted rewards, and queues it for the trainer."""

    def __init__(self, gate: StalenessGate, script: list[list[float]]):
        self.gate, self.script, self.queue, self.produced = gate, iter(script), deque(), 0

    def take(self, n: int) -> list[list[Trajectory]]:
        while self.gate.can_admit(N):
            self.gate.admit(N)
            self.queue.append(_group(self.produced, next(self.script)))
            self.produced += 1
        out, got = [], 0
        while got < n:
            if not self.queue:
                raise TimeoutError(f"the gate admits nothing more ({self.gate.admitted} of {self.gate.limit} "
                                   "counted): the trainer would wait for ever")
            out.append(self.queue.popleft())
            got += len(out[-1])
        return out


def test_split_by_signal_uses_the_zero_variance_rule():
    kept, flat = split_by_signal([_group(0, [1, 1, 1, 1]), _group(1, [0, 1, 0, 0]), _group(2, [0.5] * 4)])
    assert [g[0].group_id for g in kept] == ["g1"] and [g[0].group_id for g in flat] == ["g0", "g2"]


@pytest.mark.parametrize("eta", [0, 2])
def test_filtered_groups_are_refilled_and_released_from_the_gate(eta):
    # B = 8 = two groups; version 0. At eta = 0 the gate admits g0 (all right: no signal) and g1; g0 is
    # set aside and released, so g2 (all wrong) is admitted, set aside and released, then g3. At eta = 2
    # the gate admits six groups at once: the replacements are already waiting.
    gate = StalenessGate(batch_size=8, max_staleness=eta)
    rollout = _Rollout(gate, [[1, 1, 1, 1], [0, 1, 0, 1], [0, 0, 0, 0], [1, 0, 0, 0]] + [[0, 0, 0, 1]] * 6)
    filtered = []

    def release(groups):
        filtered.extend(g[0].group_id for g in groups)
        gate.release(sum(len(g) for g in groups))

    batch = fill_batch(rollout.take, 8, release)
    assert [g[0].group_id for g in batch] == ["g1", "g3"]
    assert filtered == ["g0", "g2"]
    # the gate counts what was admitted and not released: the batch, plus the groups eta let the
    # rollout side generate ahead (none at eta = 0; up to the bound of 24 at eta = 2)
    assert gate.admitted == 8 + N * len(rollout.queue)
    assert gate.admitted == (8 if eta == 0 else gate.limit)


def test_without_the_release_the_gate_stalls():
    gate = StalenessGate(batch_size=8, max_staleness=0)
    rollout = _Rollout(gate, [[1, 1, 1, 1], [0, 1, 0, 1], [0, 1, 1, 1]])
    with pytest.raises(TimeoutError, match="admits nothing more"):
        fill_batch(rollout.take, 8, lambda groups: None)
