"""Group-relative advantages (GRPO, Dr.GRPO): one scalar per trajectory, broadcast over its tokens."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def group_advantages(rewards: Sequence[float] | np.ndarray, group_ids: Sequence[str], *, std_norm: bool,
                     eps: float = 1e-6) -> torch.Tensor:
    """Reward minus its group's mean, divided by the group's std when `std_norm` (GRPO).

    A group whose rewards are all equal carries no signal and gets zeros. Returns [N].
    """
    r = np.asarray(rewards, dtype=np.float64)
    out = np.zeros_like(r)
    groups: dict[str, list[int]] = {}
    for i, g in enumerate(group_ids):
        groups.setdefault(g, []).append(i)
    for idx in groups.values():
        vals = r[idx]
        centred = vals - vals.mean()
        if std_norm:
            std = vals.std()
            centred = centred / (std + eps) if std > eps else np.zeros_like(centred)
        out[idx] = centred
    return torch.as_tensor(out, dtype=torch.float32)


def broadcast_to_tokens(adv: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """[N] trajectory advantages -> [N, T] token advantages (zero where loss_mask is 0)."""
    return adv[:, None] * loss_mask.to(adv.dtype)
