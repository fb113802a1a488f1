"""A train step's statistics: what arrived (`arrival_stats`, `version_stats`), how stale the trained
tokens were (`staleness_stats`), and what the micro-batches measured, gathered over them (and, in
a data-parallel backend, combined over ranks): weighted means, maxima, per-minibatch totals,
gradient norms.

    acc = StatsAccumulator()
    acc.add({"clip_frac": 0.1, "behav_weight_max": 1.3}, weight=120)   # measured on 120 tokens
    acc.add_total("loss", 0.42)                                         # a part of this minibatch's loss
    acc.add_grad_norm(2.5, max_norm=1.0)                                # one per optimizer step
    acc.result()  # {"train/clip_frac": ..., "train/behav_weight_max": ..., "train/loss": ..., "train/grad_norm": 2.5,
                  #  "train/grad_norm_clipped": 1.0, "train/grad_clipped_frac": 1.0}

Values and weights may be 0-dim tensors on the trainer's device (a loss's stats, a token count
measured on the device): they are added up there, and `read()` copies them all to the host in
one transfer, once per step, so no micro-batch waits for the device to report its stats.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from async_rl.trainer.advantages import no_signal
from async_rl.types import Trajectory

Value = float | torch.Tensor


def _max(a: Value | None, b: Value) -> Value:
    if a is None:
        return b
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        ref = a if isinstance(a, torch.Tensor) else b
        return torch.maximum(torch.as_tensor(a, dtype=ref.dtype, device=ref.device),
                             torch.as_tensor(b, dtype=ref.dtype, device=ref.device))
    return max(a, b)


def host_floats(values: list[Value]) -> list[float]:
    """`values` as floats; the tensors among them are read in one device-to-host copy."""
    tensors = [v.detach().reshape(()).to(torch.float64) for v in values if isinstance(v, torch.Tensor)]
    read = iter(torch.stack(tensors).tolist() if tensors else [])
    return [next(read) if isinstance(v, torch.Tensor) else float(v) for v in values]


class StatsAccumulator:
    """Stats of a step's micro-batches, prefixed `train/`: weighted means (each `add` says how many
    tokens its stats were measured on), maxima for `*_max` keys, and totals per minibatch (a
    minibatch's loss is the sum of its micro-batches' parts) averaged over the minibatches."""

    def __init__(self) -> None:
        self.sums: dict[str, Value] = {}
        self.weights: dict[str, Value] = {}
        self.maxes: dict[str, Value] = {}
        self.totals: dict[str, Value] = {}
        self.norms: list[float] = []
        self.clipped_norms: list[float] = []

    def add(self, stats: dict[str, Value], weight: Value) -> None:
        for key, value in stats.items():
            if key.endswith("_max"):
                self.maxes[key] = _max(self.maxes.get(key), value)
            else:
                self.sums[key] = self.sums.get(key, 0.0) + value * weight
                self.weights[key] = self.weights.get(key, 0.0) + weight

    def add_total(self, key: str, value: Value) -> None:
        self.totals[key] = self.totals.get(key, 0.0) + value

    def add_grad_norm(self, norm: float, max_norm: float = 0.0) -> None:
        """The gradient norm of one optimizer step before clipping, and what clipping at `max_norm`
        (0 = off) left: torch's clip_grad_norm_ scales by max_norm / (norm + 1e-6) where that is < 1."""
        self.norms.append(norm)
        scale = min(1.0, max_norm / (norm + 1e-6)) if max_norm > 0 and math.isfinite(norm) else 1.0
        self.clipped_norms.append(norm * scale)

    def read(self) -> None:
        """Every value that is still a tensor becomes a float (one device-to-host copy for all)."""
        tables = (self.sums, self.weights, self.maxes, self.totals)
        keys = [(t, k) for t in tables for k in t]
        for (table, key), value in zip(keys, host_floats([table[key] for table, key in keys])):
            table[key] = value

    def result(self) -> dict[str, float]:
        self.read()
        out = {f"train/{k}": v / self.weights[k] if self.weights[k] else 0.0 for k, v in self.sums.items()}
        out.update({f"train/{k}": v for k, v in self.maxes.items()})
        out.update({f"train/{k}": v / max(1, len(self.norms)) for k, v in self.totals.items()})
        out["train/grad_norm"] = float(np.mean(self.norms)) if self.norms else 0.0
        out["train/grad_norm_clipped"] = float(np.mean(self.clipped_norms)) if self.clipped_norms else 0.0
        out["train/grad_clipped_frac"] = (float(np.mean([c < n for c, n in zip(self.clipped_norms, self.norms)]))
                                          if self.norms else 0.0)
        return out


def arrival_stats(trajs: list[Trajectory], kept: list[Trajectory]) -> dict[str, Any]:
    """What the batch looked like on arrival (rewards and lengths of everything received)."""
    rewards = np.array([t.reward for t in trajs], dtype=np.float64)
    lengths = [len(t.response_ids) for t in trajs]
    agent: dict[str, list[float]] = {}  # per-episode agent metrics (tool calls, turns, ...): batch means
    for t in trajs:
        for key, value in t.info.items():
            if key.startswith("agent/") and isinstance(value, (int, float)) and not isinstance(value, bool):
                agent.setdefault(key, []).append(float(value))
    return {
        **{f"rollout/{key}": float(np.mean(vals)) for key, vals in agent.items()},
        "train/reward_mean": float(rewards.mean()) if len(trajs) else 0.0,
        "train/reward_std": float(rewards.std()) if len(trajs) else 0.0,
        "train/response_len_mean": float(np.mean(lengths)) if lengths else 0.0,
        "train/truncated_frac": float(np.mean([t.finish_reason == "length" for t in trajs])) if trajs else 0.0,
        "train/response_lens": lengths,  # every arrival's length: the simulator's length distribution
        "train/prompt_len_mean": float(np.mean([len(t.prompt_ids) for t in trajs])) if trajs else 0.0,
        "train/batch_tokens": float(sum(len(t.prompt_ids) + len(t.response_ids) for t in kept)),
        "train/num_trajectories": float(len(kept)),
        "rollout/interrupted": float(sum(1 for t in trajs if t.num_interruptions > 0)),
    }


def group_stats(trajs: list[Trajectory]) -> dict[str, Any]:
    """The trained groups' rewards: each group's mean (`train/group_reward_means`, in arrival order; with
    a 0/1 reward a group at 1 is solved by every sample, at 0 by none), and the share of groups without
    reward variance (`train/zero_var_groups_frac`): their advantages are 0, so they train nothing."""
    groups: dict[Any, list[float]] = {}
    for t in trajs:
        groups.setdefault(t.group_id, []).append(float(t.reward))
    rewards = [np.array(r) for r in groups.values()]
    return {"train/group_reward_means": [float(r.mean()) for r in rewards],
            "train/zero_var_groups_frac": sum(1 for r in rewards if no_signal(r)) / max(1, len(rewards))}


def version_stats(trajs: list[Trajectory], policy_version: int, max_staleness: int) -> dict[str, Any]:
    """How old each arriving trajectory is (lag of its oldest sampled token, a histogram over
    0..max_staleness and beyond; newer than the weights counts in dropped_future, not here) and
    how many policy versions sampled its tokens."""
    hist = [0] * (max_staleness + 2)  # the last bin counts anything older than the bound
    mixed = []
    for t in trajs:
        sampled = t.versions[t.loss_mask.astype(bool)]
        if len(sampled) and int(sampled.max()) <= policy_version:
            hist[min(policy_version - int(sampled.min()), max_staleness + 1)] += 1
            mixed.append(len(np.unique(sampled)))
    return {"train/staleness_hist": hist,
            "train/versions_per_traj_mean": float(np.mean(mixed)) if mixed else 0.0,
            "train/versions_per_traj_max": float(max(mixed)) if mixed else 0.0}


def staleness_stats(trajs: list[Trajectory], policy_version: int) -> dict[str, float]:
    """How many versions behind `policy_version` each trained token was sampled."""
    lags = [policy_version - t.versions[t.loss_mask.astype(bool)].astype(np.int64) for t in trajs]
    lag = np.concatenate(lags) if lags else np.zeros(0, np.int64)
    return {"train/staleness_max": float(lag.max()) if lag.size else 0.0,
            "train/staleness_mean": float(lag.mean()) if lag.size else 0.0,
            "train/num_tokens": float(lag.size)}
