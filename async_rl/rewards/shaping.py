"""Reward rules applied to every trajectory, whatever agent loop made it.

A response cut at the length limit (finish_reason "length") is scored as if it had ended there, so a
policy that stops writing its answer and goes on ("23 + 45 = 68. The answer is 68, ...") is still paid
while its last number happens to be right, and nothing teaches it to stop. `rollout.truncated_reward`
pays such a response a fixed reward instead (DAPO's overlong punishment, in its hard form).
"""

from __future__ import annotations

import dataclasses

from async_rl.types import Trajectory


def truncated_reward(traj: Trajectory, reward: float | None) -> Trajectory:
    """`traj` paid `reward` in place of its score when the model's own tokens were cut at the length limit
    (the score kept in info["score"]); `traj` itself when `reward` is None, the response ended by itself,
    or what was cut is a tool's or a user's reply (its last token not sampled by the model)."""
    if reward is None or traj.finish_reason != "length" or not len(traj.loss_mask) or not traj.loss_mask[-1]:
        return traj
    return dataclasses.replace(traj, reward=float(reward), info={**traj.info, "score": traj.reward})
