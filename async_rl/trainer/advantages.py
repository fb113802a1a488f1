"""Advantage estimators: group-relative (GRPO, Dr.GRPO, RLOO) trajectory credit, optionally plus turn credit.

A group is the n samples drawn for one prompt (same `group_id`). An estimator maps a
batch of trajectories to advantages, chosen by `trainer.advantage` from `ADVANTAGES`:

- `grpo` (the default; Flow-GRPO's multi-turn rule): a trajectory's advantage is its reward
  minus the group mean, divided by the group's standard deviation (`trainer.adv_std_norm`,
  else left unscaled as in Dr.GRPO). The reward is trajectory-level, so every trained
  token of a multi-turn episode, in every model turn, gets the same value. Returns [N].
- `dr_grpo` (Dr.GRPO, "Understanding R1-Zero-like training"): the reward minus the group mean,
  never divided by the std (whatever `trainer.adv_std_norm` says): the std favours groups that
  are nearly all right or all wrong. Dr.GRPO's other half, no per-sequence length
  normalisation, is in the loss aggregation (`trainer.loss_agg`, trainer/loss.py). Returns [N].
- `rloo` (REINFORCE leave-one-out): the reward minus the mean of the OTHER samples of its
  group, r_i - (sum_j r_j - r_i) / (n - 1) = n / (n - 1) * (r_i - mean); no std. A group of
  one has no other sample and gets 0. Returns [N].
- `grpo_turn`: the `grpo` value on every trained token, plus `trainer.turn_adv_coef` times a
  group-normalised turn score on the tokens of each scored turn. Returns [N, M]: one value
  per trained token (loss_mask 1), in order, zero-padded to the longest M.

Turn scores come from the agent loop (`info["turn_scores"]`, `info["turn_ends"]`: the score
of a model turn — e.g. a simulated user's verdict — and where that turn ends in the
response). What `grpo_turn` does with them, and why:

- *Which tokens a score credits*: the trained tokens from the end of the previous scored
  turn up to the end of this one. A user's verdict judges everything the model did since
  the user last spoke, tool-calling turns included; tokens after the last scored turn get
  the trajectory term only.
- *Baseline per turn depth*: the k-th scored turn of a trajectory is normalised against the
  k-th scored turns of the other trajectories of its group (same prompt, same depth), with
  the same rule as the trajectory term (zero-variance sets, including sets of one, give 0).
  Pooling all depths would blame a retry for being a retry: later turns are reached only
  after failures and score differently by construction.
- *Immediate scores, not returns*: a turn gets its own score, not the sum of later ones.
  The long-range effect of a turn (a wrong answer that leads to a hint that leads to a
  right one) is already in the trajectory term, which every turn shares; adding future
  turn scores again would count it twice. Both terms are centred within the group, so the
  sum stays a baseline-corrected signal; `turn_adv_coef` sets how much immediate feedback
  weighs against the outcome. With no turn scores in a batch, `grpo_turn` equals `grpo`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from async_rl.config import TrainerConfig
from async_rl.types import Trajectory


def no_signal(rewards: np.ndarray, eps: float = 1e-6) -> bool:
    """A group whose rewards are all equal (within eps; a group of one included) carries no
    learning signal: group-relative advantages are zero, and dynamic sampling drops it."""
    r = np.asarray(rewards, dtype=np.float64).reshape(-1)
    return not len(r) or float(np.abs(r - r.mean()).max()) <= eps


def group_advantages(rewards: np.ndarray | torch.Tensor | Sequence[float], group_ids: Sequence[Any], *,
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
    members: dict[Any, list[int]] = {}
    for i, g in enumerate(group_ids):
        members.setdefault(g, []).append(i)
    for idx in members.values():
        vals = r[idx]
        if no_signal(vals, eps):
            continue  # zero variance: leave zeros
        centred = vals - vals.mean()
        out[idx] = centred / (vals.std() + eps) if std_norm else centred
    return torch.as_tensor(out, dtype=torch.float32)


def grpo(trajs: Sequence[Trajectory], cfg: TrainerConfig) -> torch.Tensor:
    """[N] group-normalised trajectory rewards (broadcast over the tokens by the batcher)."""
    return group_advantages([t.reward for t in trajs], [t.group_id for t in trajs], std_norm=cfg.adv_std_norm)


def dr_grpo(trajs: Sequence[Trajectory], cfg: TrainerConfig) -> torch.Tensor:
    """[N] group-centred trajectory rewards, never scaled by the group std."""
    return group_advantages([t.reward for t in trajs], [t.group_id for t in trajs], std_norm=False)


def rloo(trajs: Sequence[Trajectory], cfg: TrainerConfig) -> torch.Tensor:
    """[N] reward minus the mean reward of the other samples of the group (0 for a group of one)."""
    ids = [t.group_id for t in trajs]
    sizes = Counter(ids)
    scale = torch.tensor([sizes[g] / (sizes[g] - 1) if sizes[g] > 1 else 0.0 for g in ids], dtype=torch.float32)
    return dr_grpo(trajs, cfg) * scale


def turn_scores(t: Trajectory) -> tuple[list[float], list[int]]:
    """(scores, ends) of a trajectory's scored turns, checked: ends ascending within the response."""
    scores, ends = t.info.get("turn_scores", []), t.info.get("turn_ends", [])
    if len(scores) != len(ends):
        raise ValueError(f"trajectory {t.id}: info.turn_scores has {len(scores)} entries but info.turn_ends "
                         f"{len(ends)}")
    ends = [int(e) for e in ends]
    if any(b < a for a, b in zip(ends, ends[1:])) or any(not 0 <= e <= len(t.response_ids) for e in ends):
        raise ValueError(f"trajectory {t.id}: info.turn_ends must ascend within [0, {len(t.response_ids)}], "
                         f"got {ends}")
    scores = [float(s) for s in scores]
    if not all(np.isfinite(scores)):
        raise ValueError(f"trajectory {t.id}: info.turn_scores must be finite, got {scores}")
    return scores, ends


def grpo_turn(trajs: Sequence[Trajectory], cfg: TrainerConfig) -> torch.Tensor:
    """[N, M] per trained token: the `grpo` value plus coef x the depth-wise group-normalised
    score of the turn the token belongs to (see the module docstring)."""
    base = grpo(trajs, cfg).numpy()
    parsed = [turn_scores(t) for t in trajs]
    keys = [(t.group_id, k) for t, (scores, _) in zip(trajs, parsed) for k in range(len(scores))]
    flat = [s for scores, _ in parsed for s in scores]
    turn_adv = group_advantages(flat, keys, std_norm=cfg.adv_std_norm).numpy() if flat else np.zeros(0)
    rows, at = [], 0
    for t, (scores, ends), a in zip(trajs, parsed, base):
        pos = np.flatnonzero(t.loss_mask)  # response positions of the trained tokens
        row = np.full(len(pos), a, dtype=np.float64)
        start = 0
        for k, end in enumerate(ends):
            row[(pos >= start) & (pos < end)] += cfg.turn_adv_coef * turn_adv[at + k]
            start = end
        at += len(scores)
        rows.append(row)
    out = torch.zeros(len(trajs), max([1] + [len(r) for r in rows]), dtype=torch.float32)
    for i, row in enumerate(rows):
        out[i, :len(row)] = torch.as_tensor(row, dtype=torch.float32)
    return out


AdvantageFn = Callable[[Sequence[Trajectory], TrainerConfig], torch.Tensor]
ADVANTAGES: dict[str, AdvantageFn] = {"grpo": grpo, "grpo_turn": grpo_turn, "dr_grpo": dr_grpo, "rloo": rloo}


def get_advantage(name: str) -> AdvantageFn:
    if name not in ADVANTAGES:
        raise ValueError(f"trainer.advantage: unknown estimator {name!r}; allowed: {', '.join(sorted(ADVANTAGES))}")
    return ADVANTAGES[name]


def broadcast_to_tokens(advantages: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Advantages -> [B, T] token advantages, zero where loss_mask [B, T] is 0.

    `advantages` is [B] (one value per trajectory, on all its trained tokens) or [B, M]
    (one value per trained token, in order: row b's k-th 1 in loss_mask gets [b, k]).
    """
    B = loss_mask.shape[0]
    mask = loss_mask.to(torch.float32)
    if advantages.dim() == 1 and advantages.shape[0] == B:
        return advantages[:, None].to(torch.float32) * mask
    if advantages.dim() != 2 or advantages.shape[0] != B:
        raise ValueError(f"advantages: expected shape [{B}] or [{B}, trained tokens], got {tuple(advantages.shape)}")
    counts = loss_mask.bool().sum(dim=1)
    if advantages.shape[1] == 0 and not counts.any():
        return torch.zeros_like(mask)
    if B and int(counts.max()) > advantages.shape[1]:
        raise ValueError(f"advantages: {advantages.shape[1]} per-token values per row, but a row trains "
                         f"{int(counts.max())} tokens")
    order = (loss_mask.bool().long().cumsum(dim=1) - 1).clamp(0, max(advantages.shape[1] - 1, 0))  # [B, T]
    return advantages.to(torch.float32).gather(1, order) * mask
