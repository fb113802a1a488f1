"""Group-relative advantages (GRPO, Dr.GRPO): one scalar per trajectory, broadcast over its tokens.

A group is the n samples drawn for one prompt (same `group_id`). A trajectory's
advantage is its reward minus the group mean, divided by the group's standard
deviation under GRPO (`std_norm=True`) or left unscaled under Dr.GRPO. The reward is
trajectory-level, so every trained token of a multi-turn episode gets the same value.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def group_advantages(rewards: np.ndarray | torch.Tensor | Sequence[float], group_ids: Sequence[str], *,
                     std_norm: bool, eps: float = 1e-6) -> torch.Tensor:
    """[N] float32 advantages for N trajectories with rewards [N] and their group ids.

    The std is the population std of the group (ddof=0). A group whose rewards are all
    equal (including a group of one) carries no learning signal and gets zeros.
    """
    if isinstance(rewards, torch.Tensor):
        rewards = rewards.detach().cpu().numpy()
    r = np.asarray(rewards, dtype=np.float64).reshape(-1)
    if len(group_ids) != len(r):
        raise ValueError(f"group_ids: expected {len(r)} ids (one per reward), got {len(group_ids)}")
    if not np.all(np.isfinite(r)):
        raise ValueError("rewards: must be finite (got NaN or inf)")
    out = np.zeros_like(r)
    members: dict[str, list[int]] = {}
    for i, g in enumerate(group_ids):
        members.setdefault(g, []).append(i)
    for idx in members.values():
        vals = r[idx]
        centred = vals - vals.mean()
        if np.abs(centred).max() <= eps:
            continue  # zero variance: leave zeros
        out[idx] = centred / (vals.std() + eps) if std_norm else centred
    return torch.as_tensor(out, dtype=torch.float32)


def broadcast_to_tokens(advantages: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """[B] trajectory advantages -> [B, T] token advantages, zero where loss_mask is 0."""
    if advantages.dim() != 1 or advantages.shape[0] != loss_mask.shape[0]:
        raise ValueError(f"advantages: expected shape [{loss_mask.shape[0]}], got {tuple(advantages.shape)}")
    return advantages[:, None].to(torch.float32) * loss_mask.to(torch.float32)
