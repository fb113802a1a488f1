"""rollout.truncated_reward: a response cut at the length limit is paid the set reward, not its score."""

import numpy as np
import pytest

from async_rl.config import ConfigError, load_config
from async_rl.rewards.shaping import truncated_reward
from async_rl.trainer.stats import arrival_stats
from async_rl.types import Trajectory


def _traj(finish: str, reward: float, mask=(1, 1, 1)) -> Trajectory:
    n = len(mask)
    return Trajectory(id="t", group_id="g", prompt_ids=np.zeros(2, np.int32), response_ids=np.zeros(n, np.int32),
                      loss_mask=np.array(mask, np.uint8), behav_logprobs=np.zeros(n, np.float32),
                      versions=np.where(np.array(mask) > 0, 0, -1).astype(np.int32), reward=reward,
                      finish_reason=finish)


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


def test_a_cut_tool_or_user_reply_is_not_the_models_truncation():
    """A multi-turn episode whose budget ran out in a tool's output ends 'length' too: its last token was
    not sampled by the model, so it keeps its score."""
    assert truncated_reward(_traj("length", 1.0, mask=(1, 1, 0, 0)), 0.0).reward == 1.0
    assert truncated_reward(_traj("length", 1.0, mask=(1, 0, 0, 1)), 0.0).reward == 0.0


def test_the_share_of_cut_arrivals_is_a_train_metric():
    trajs = [_traj("length", 0.0), _traj("stop", 1.0), _traj("stop", 1.0), _traj("abort", 0.0)]
    assert arrival_stats(trajs, trajs)["train/truncated_frac"] == 0.25


@pytest.mark.parametrize("value", ["nan", "inf"])
def test_a_truncated_reward_that_is_not_a_number_is_refused_by_name(value):
    with pytest.raises(ConfigError, match="rollout.truncated_reward: must be a finite number"):
        load_config(None, [f"rollout.truncated_reward={value}"])
