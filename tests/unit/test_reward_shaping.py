"""rollout.truncated_reward: a response cut at the length limit is paid the set reward, not its score."""

import numpy as np
import pytest

from async_rl.rewards.shaping import truncated_reward
from async_rl.types import Trajectory


def _traj(finish: str, reward: float) -> Trajectory:
    n = 3
    return Trajectory(id="t", group_id="g", prompt_ids=np.zeros(2, np.int32), response_ids=np.zeros(n, np.int32),
                      loss_mask=np.ones(n, np.uint8), behav_logprobs=np.zeros(n, np.float32),
                      versions=np.zeros(n, np.int32), reward=reward, finish_reason=finish)


@pytest.mark.parametrize("finish,setting,reward,score", [
    ("length", 0.0, 0.0, 1.0),    # right last number, cut: paid 0, its score kept
    ("length", -0.5, -0.5, 0.0),
    ("stop", 0.0, 1.0, None),     # ended by itself: its score
    ("abort", 0.0, 1.0, None),
    ("length", None, 1.0, None),  # unset: scored as before
])
def test_only_a_cut_response_is_paid_the_truncated_reward(finish, setting, reward, score):
    t = truncated_reward(_traj(finish, 1.0 if score is None else score), setting)
    assert t.reward == reward and t.info.get("score") == score
