"""The plain-PyTorch PPO trainer: one `train_step` per batch of groups.

    trainer = PPOTrainer(model, TrainerConfig(), temperature=1.0, max_staleness=1, seed=0)
    stats = trainer.train_step(groups)      # list of groups, each a list of Trajectory
    weights = trainer.state_dict()          # publish as version trainer.policy_version

A step drops trajectories whose oldest sampled token is more than `max_staleness`
versions old, computes group-relative advantages, recomputes proximal log-probs with
the current weights, takes `minibatches` AdamW steps on the decoupled PPO loss, and
advances `policy_version`.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from async_rl.config import TrainerConfig
from async_rl.trainer.advantages import group_advantages
from async_rl.trainer.batching import Batch, collate, micro_batches, token_logprobs
from async_rl.trainer.loss import LOSSES
from async_rl.types import Trajectory

logger = logging.getLogger(__name__)


class PPOTrainer:
    def __init__(self, model: torch.nn.Module, cfg: TrainerConfig, *, temperature: float, max_staleness: int,
                 seed: int, policy_version: int = 0, loss: str = "decoupled_ppo"):
        self.model = model
        self.cfg = cfg
        self.temperature = temperature
        self.max_staleness = max_staleness
        self.policy_version = policy_version
        self.loss_fn = LOSSES[loss]
        torch.manual_seed(seed)
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)

    # ------------------------------------------------------------------ public
    def train_step(self, groups: list[list[Trajectory]]) -> dict[str, float]:
        t0 = time.perf_counter()
        trajs = [t for g in groups for t in g]
        floor = self.policy_version - self.max_staleness
        kept = [t for t in trajs if t.oldest_version() >= floor]
        stats: dict[str, float] = {"train/dropped_stale": len(trajs) - len(kept),
                                   "train/num_trajectories": len(kept)}
        rewards = np.array([t.reward for t in trajs], dtype=np.float64)
        stats.update({"train/reward_mean": float(rewards.mean()) if len(trajs) else 0.0,
                      "train/reward_std": float(rewards.std()) if len(trajs) else 0.0,
                      "rollout/interrupted": sum(1 for t in trajs if t.num_interruptions > 0),
                      "train/response_len_mean": float(np.mean([len(t.response_ids) for t in trajs]))
                      if trajs else 0.0})
        if kept:
            stats.update(self._update(kept))
        else:
            logger.warning("every trajectory of this batch was too stale: no update at version %d",
                           self.policy_version)
            stats.update({"train/loss": 0.0, "train/staleness_max": 0, "train/staleness_mean": 0.0,
                          "train/num_tokens": 0, "train/grad_norm": 0.0})
        self.policy_version += 1
        stats["timing/train_s"] = time.perf_counter() - t0
        return stats

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().cpu() for k, v in self.model.state_dict().items()}

    # ------------------------------------------------------------------ internals
    def _update(self, trajs: list[Trajectory]) -> dict[str, float]:
        adv = group_advantages([t.reward for t in trajs], [t.group_id for t in trajs],
                               std_norm=self.cfg.adv_std_norm)
        minibatches = self._split(trajs, adv)
        stats = self._staleness(minibatches)
        prox = self._prox_logprobs(minibatches) if self.cfg.minibatches > 1 else None
        losses, norms, extra = [], [], []
        self.model.train()
        try:
            for m, micros in enumerate(minibatches):
                total = sum(b.num_tokens for b in micros) or 1
                self.optimizer.zero_grad(set_to_none=True)
                step_loss = 0.0
                for k, batch in enumerate(micros):
                    logprobs = token_logprobs(self.model, batch.input_ids, batch.attention_mask, self.temperature)
                    prox_lp = prox[m][k] if prox is not None else logprobs.detach()
                    loss, s = self.loss_fn(logprobs, prox_lp, batch.behav_logprobs, batch.advantages,
                                           batch.loss_mask, eps_clip=self.cfg.eps_clip,
                                           behav_weight_cap=self.cfg.behav_weight_cap)
                    (loss * (batch.num_tokens / total)).backward()
                    step_loss += float(loss) * batch.num_tokens / total
                    extra.append(s)
                clip = self.cfg.grad_clip if self.cfg.grad_clip > 0 else float("inf")
                norms.append(float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip)))
                self.optimizer.step()
                losses.append(step_loss)
        finally:
            self.model.eval()
        stats.update({"train/loss": float(np.mean(losses)), "train/grad_norm": float(np.mean(norms))})
        for key in extra[0]:
            stats[key] = float(np.mean([s[key] for s in extra]))
        return stats

    def _split(self, trajs: list[Trajectory], adv: torch.Tensor) -> list[list[Batch]]:
        """Minibatches (whole groups together when possible), each a list of micro-batches."""
        n = max(1, min(self.cfg.minibatches, len(trajs)))
        chunks = np.array_split(np.arange(len(trajs)), n)
        out = []
        for chunk in chunks:
            sub = [trajs[i] for i in chunk]
            micros = micro_batches(sub, self.cfg.micro_batch_tokens)
            out.append([collate(trajs, adv, [int(chunk[j]) for j in idx]) for idx in micros])
        return out

    def _staleness(self, minibatches: list[list[Batch]]) -> dict[str, float]:
        lags = []
        for micros in minibatches:
            for b in micros:
                trained = b.loss_mask.bool()
                lags.append((self.policy_version - b.versions[trained]).float())
        lag = torch.cat(lags) if lags else torch.zeros(1)
        return {"train/staleness_max": int(lag.max()) if lag.numel() else 0,
                "train/staleness_mean": float(lag.mean()) if lag.numel() else 0.0,
                "train/num_tokens": int(lag.numel())}

    @torch.no_grad()
    def _prox_logprobs(self, minibatches: list[list[Batch]]) -> list[list[torch.Tensor]]:
        return [[token_logprobs(self.model, b.input_ids, b.attention_mask, self.temperature) for b in micros]
                for micros in minibatches]
