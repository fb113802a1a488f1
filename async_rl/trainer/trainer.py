"""The plain-PyTorch PPO trainer (CPU or one GPU): one `train_step` per batch of groups.

    model = load_model(ModelConfig(), seed=0)
    trainer = PPOTrainer(model, TrainerConfig(), temperature=1.0, max_staleness=1, seed=0)
    stats = trainer.train_step(groups)      # list of groups, each a list of Trajectory
    publisher.publish(trainer.weights(), trainer.policy_version)

A step (1) drops trajectories whose oldest sampled token is more than `max_staleness`
versions older than `policy_version`, (2) computes group-relative advantages, (3)
recomputes proximal log-probs with the current weights, (4) takes `cfg.minibatches`
AdamW steps on the policy loss (`cfg.loss`, its token terms added up as `cfg.loss_agg` says
over the minibatch), each accumulating gradients over micro-batches of at most
`cfg.micro_batch_tokens` tokens (packed rows, `cfg.pack_sequences`; padded: rows x longest),
and (5) advances `policy_version`. A micro-batch's stats stay on the device until the step
ends (trainer/stats.py): the host waits for the device once per optimizer step (the gradient
norm), not per micro-batch.
A trajectory sampled (in part) by weights NEWER than `policy_version` comes from a future a
resume threw away (the trainer went back to a checkpoint): it is dropped too, and counted
(`train/dropped_future`). A batch whose every trajectory is dropped is not a train step: nothing is updated, the
version stays, and the stats say `train/skipped_batch` (the caller tells the rollout side,
whose staleness gate then stops counting those trajectories) — a side that fell behind
cannot make the trainer spin through versions without training.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import math
import time
from functools import partial
from typing import Any

import numpy as np
import torch

from async_rl.config import TrainerConfig
from async_rl.trainer.advantages import get_advantage
from async_rl.trainer.batching import Batch, collate, trained_tokens
from async_rl.trainer.kl_probe import KlProbe
from async_rl.trainer.logprobs import packing_error, token_logprobs
from async_rl.trainer.loss import get_loss, get_loss_agg, kl_penalty, logprob_mismatch
from async_rl.trainer.lr_schedule import get_lr_schedule
from async_rl.trainer.plan import Minibatch, Share, plan_minibatch, score_mask
from async_rl.trainer.stats import StatsAccumulator, arrival_stats, group_stats, staleness_stats, version_stats
from async_rl.types import STALE_MASKED, Trajectory
from async_rl.utils.hardware import resolve_dtype
from async_rl.utils.weights import WeightSource

logger = logging.getLogger(__name__)

# probe log-probs packed vs padded: float noise is ~1e-6, sequences that see each other ~0.1 (logprobs.py)
_PACKING_TOL = 1e-3

# reported when a step has nothing to train on, so every step logs the same keys
_NO_UPDATE = {"train/loss": 0.0, "train/grad_norm": 0.0, "train/clip_frac": 0.0, "train/ratio_mean": 1.0,
              "train/approx_kl": 0.0, "train/behav_weight_mean": 1.0, "train/behav_weight_max": 1.0,
              "train/behav_capped_frac": 0.0, "train/behav_masked_frac": 0.0, "train/staleness_max": 0.0,
              "train/staleness_mean": 0.0, "train/num_tokens": 0.0, "train/optimizer_steps": 0.0,
              "train/skipped_nonfinite": 0.0, "train/logprob_mismatch_mean": 0.0, "train/logprob_mismatch_max": 0.0,
              "train/logprob_mismatch_kl": 0.0, "train/logprob_mismatch_frac": 0.0, "train/kl_prev": 0.0,
              "train/kl_prev_frac": 0.0, "train/grad_norm_clipped": 0.0, "train/grad_clipped_frac": 0.0}


def split_by_age(trajs: list[Trajectory], policy_version: int, max_staleness: int,
                 stale_tokens: str = "drop") -> tuple[list[Trajectory], list[Trajectory], list[Trajectory]]:
    """(kept, over-stale, from the future): the one rule of which trajectories a step may train.
    Over-stale: the oldest sampled token is more than `max_staleness` versions behind; from the
    future: a sampled token is newer than `policy_version` (weights a resume discarded).
    `stale_tokens="mask"` (trainer.stale_tokens) keeps an over-stale trajectory that has sampled
    tokens within the bound, with the older ones taken out of its loss mask (`within_bound`): only
    one with none left is over-stale. Either way no kept token is more than max_staleness behind."""
    if stale_tokens not in ("drop", "mask"):
        raise ValueError(f"trainer.stale_tokens: must be drop or mask, got {stale_tokens!r}")
    floor = policy_version - max_staleness
    kept, stale, future = [], [], []
    for t in trajs:
        if t.newest_version() > policy_version:
            future.append(t)
        elif t.oldest_version() >= floor:
            kept.append(t)
        elif stale_tokens == "mask" and t.newest_version() >= floor:
            kept.append(t.within_bound(floor))
        else:
            stale.append(t)
    return kept, stale, future


class PPOTrainer:
    """Decoupled PPO on an HF causal LM; `policy_version` is the version of the current weights."""

    can_pack = True  # micro-batches may be packed rows (a backend whose model cannot take them says False)
    can_probe = True  # may run a forward of its own (the KL probe); ranks in lock step run only what rank 0 sends

    def __init__(self, model: torch.nn.Module, cfg: TrainerConfig, *, temperature: float, max_staleness: int,
                 seed: int, policy_version: int = 0, loss: str | None = None):
        if max_staleness < 0:
            raise ValueError(f"max_staleness: must be >= 0, got {max_staleness}")
        if cfg.minibatches < 1:
            raise ValueError(f"trainer.minibatches: must be >= 1, got {cfg.minibatches}")
        if cfg.micro_batch_tokens < 1:
            raise ValueError(f"trainer.micro_batch_tokens: must be >= 1, got {cfg.micro_batch_tokens}")
        self.model = model
        self.cfg = cfg
        self.temperature = temperature
        self.max_staleness = max_staleness
        self.policy_version = policy_version
        self.loss_fn = get_loss(loss or cfg.loss)
        self.advantage_fn = get_advantage(cfg.advantage)
        self.loss_agg = get_loss_agg(cfg.loss_agg)
        self.lr_schedule = get_lr_schedule(cfg.lr_schedule)
        self.device = next(model.parameters()).device
        self.compute_dtype = resolve_dtype(cfg.compute_dtype, self.device).dtype  # autocast dtype
        # pi_ref of trainer.kl_coef: the weights this trainer starts from (a resume loads into `model` only)
        self.ref_model = self._frozen_copy(model) if cfg.kl_coef > 0 else None
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=cfg.lr, weight_decay=cfg.weight_decay)
        self._rng = np.random.default_rng(seed)  # minibatch assignment; the only randomness here
        self.hf_export = None  # set by a backend: makes each checkpoint a Hugging Face model directory
        self.packed = self.can_pack and cfg.pack_sequences is not False and self._packing_holds(cfg.pack_sequences)
        self.kl_probe = KlProbe(cfg.kl_probe_seqs if self.can_probe else 0)  # train/kl_init (trainer/kl_probe.py)

    # ------------------------------------------------------------------ public
    def train_step(self, groups: list[list[Trajectory]]) -> dict[str, float]:
        """Train on `groups` (each the samples of one prompt) and advance policy_version; return stats."""
        t0 = time.perf_counter()
        trajs = [t for g in groups for t in g]
        kept, stale, future = split_by_age(trajs, self.policy_version, self.max_staleness, self.cfg.stale_tokens)
        stats = arrival_stats(trajs, kept)
        stats["train/dropped_stale"] = float(len(stale))
        masked = [t.info[STALE_MASKED] for t in kept if STALE_MASKED in t.info]
        stats["train/stale_masked_trajs"] = float(len(masked))  # kept with their over-stale tokens masked out
        stats["train/stale_masked_tokens"] = float(sum(masked))
        stats["train/dropped_future"] = float(len(future))
        stats.update(version_stats(trajs, self.policy_version, self.max_staleness))
        stats.update(group_stats(kept))
        if not kept:
            logger.warning("batch of %d trajectories dropped whole at version %d: %d sampled more than %d versions "
                           "before, %d by newer weights than these -- no train step, the version stays",
                           len(trajs), self.policy_version, len(stale), self.max_staleness, len(future))
            stats.update(_NO_UPDATE)
            stats["train/skipped_batch"] = 1.0
            stats["timing/train_s"] = time.perf_counter() - t0
            return stats
        self.kl_probe.capture(kept, self.policy_version, self._probe_batch, self._logprobs)
        stats.update(self._update(kept))
        stats["train/skipped_batch"] = 0.0
        self.policy_version += 1
        t1 = time.perf_counter()
        if self.kl_probe.ready:
            stats.update(self.kl_probe.measure(self._logprobs))
            stats["timing/kl_probe_s"] = time.perf_counter() - t1
        stats["timing/train_s"] = time.perf_counter() - t0
        return stats

    def rng_state(self) -> dict[str, Any]:
        """What a resumed run needs to draw what the uninterrupted one would. The generator's 128-bit
        state travels as JSON text (msgpack, between trainer ranks, has no integers that wide)."""
        return {"minibatch": json.dumps(self._rng.bit_generator.state)}

    def set_rng_state(self, state: dict[str, Any]) -> None:
        self._rng.bit_generator.state = json.loads(state["minibatch"])

    def weights(self) -> WeightSource:
        """The weights to publish: views of the parameters, named as model.state_dict(), read one tensor at
        a time by the publisher (no copy of the model; a tied embedding and LM head stay one tensor)."""
        return WeightSource.from_state_dict(self.model.state_dict())

    def state_dict(self) -> dict[str, torch.Tensor]:
        """A detached CPU copy of the weights, named as model.state_dict() (checkpoints and tests).

        Entries that are one tensor in the model (tied embedding and LM head) stay one
        tensor here, so a publisher can store it once.
        """
        copies: dict[tuple, torch.Tensor] = {}
        out: dict[str, torch.Tensor] = {}
        for name, t in self.model.state_dict().items():
            key = (t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype)
            if key not in copies:
                copies[key] = t.detach().to("cpu", copy=True)
            out[name] = copies[key]
        return out

    # ------------------------------------------------------------------ internals
    def _packing_holds(self, setting: bool | None) -> bool:
        """Whether this model scores packed rows as it scores padded ones (a probe through `_score`, the
        forward the trainer uses): trainer.pack_sequences=true requires it, null (auto) falls back to padded."""
        vocab = next(m.num_embeddings for m in self.model.modules() if isinstance(m, torch.nn.Embedding))
        dev = self.device

        def score(ids, mask, pos):
            return self._score(ids.to(dev), None if mask is None else mask.to(dev),
                               None if pos is None else pos.to(dev), None)
        gap = packing_error(score, vocab)
        if gap <= _PACKING_TOL:
            return True
        why = (f"trainer.pack_sequences: {type(self.model).__name__} scores two probe sequences packed in one row "
               f"{gap:.2g} away from the same sequences as padded rows (its attention lets packed sequences see "
               "each other)")
        if setting:
            raise ValueError(f"{why}; set trainer.pack_sequences=false")
        logger.warning("%s: training padded rows", why)
        return False

    def _update(self, trajs: list[Trajectory]) -> dict[str, float]:
        adv = self.advantage_fn(trajs, self.cfg)  # [N], or [N, trained tokens] (trainer.advantage)
        plans = self._plan(trajs)
        stats = staleness_stats(trajs, self.policy_version)
        return {**_NO_UPDATE, **stats, **self._optimize(self._shares(trajs, adv, plans))}

    def _optimize(self, shares: list[Share]) -> dict[str, float]:
        """One optimizer step per minibatch over this process's share of it (every rank runs this)."""
        prox = self._prox_logprobs(shares) if len(shares) > 1 else None
        ref = self._ref_logprobs(shares) if self.ref_model is not None else None
        acc = StatsAccumulator()
        steps = skipped = 0
        lr = self.cfg.lr * self.lr_schedule(self.policy_version, self.cfg.lr_warmup_steps, self.cfg.lr_decay_steps,
                                            hold=self.cfg.lr_hold_steps, floor=self.cfg.lr_min_ratio)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.model.train()
        try:
            for m, share in enumerate(shares):
                if share.total == 0:
                    continue
                self.optimizer.zero_grad(set_to_none=True)
                for k, batch in enumerate(share.micros):
                    self._accumulate(batch, share.tokens[k], prox[m][k] if prox is not None else None,
                                     ref[m][k] if ref is not None else None, acc)
                norm = self._clip_grads()
                acc.add_grad_norm(norm, self.cfg.grad_clip)
                if math.isfinite(norm):
                    self.optimizer.step()
                    steps += 1
                else:
                    logger.warning("non-finite gradient norm at version %d: optimizer step skipped",
                                   self.policy_version)
                    skipped += 1
                self.optimizer.zero_grad(set_to_none=True)
        finally:
            self.model.eval()
        stats = self._stats_result(acc)
        stats.update({"train/optimizer_steps": float(steps), "train/skipped_nonfinite": float(skipped), "train/lr": lr})
        return stats

    def _accumulate(self, batch: Batch, tokens: int, prox: torch.Tensor | None, ref: torch.Tensor | None,
                    acc: StatsAccumulator) -> None:
        """Forward + backward of one micro-batch of `tokens` trained tokens; its loss is its part of the
        minibatch's (batch.loss_weights). Its stats stay tensors: nothing here waits for the device."""
        logprobs, entropy = self._logprobs_entropy(batch)  # [B, L-1] each (entropy None: not measured)
        # one minibatch: these weights are the proximal policy, so this forward is the recompute
        prox_lp = logprobs.detach() if prox is None else prox
        loss, s = self.loss_fn(logprobs, prox_lp, batch.behav_logprobs, batch.advantages, batch.loss_mask,
                               eps_clip=self.cfg.eps_clip, behav_weight_cap=self.cfg.behav_weight_cap,
                               loss_weights=batch.loss_weights)
        if ref is not None:
            kl, kl_stats = kl_penalty(logprobs, ref, batch.loss_mask, batch.loss_weights)
            loss = loss + self.cfg.kl_coef * kl
            s.update(kl_stats)
        loss.backward()
        if entropy is not None:
            s["entropy"] = (entropy * batch.loss_mask).sum() / max(1, tokens)
        acc.add(s, tokens)
        acc.add_total("loss", loss.detach())
        # tokens the current weights sampled: prox_lp is the trainer's view of those very weights
        mismatch, measured = logprob_mismatch(prox_lp, batch.behav_logprobs, batch.versions, batch.loss_mask,
                                              self.policy_version)
        acc.add(mismatch, measured)
        acc.add({"logprob_mismatch_frac": measured / max(1, tokens)}, tokens)
        # tokens the version before sampled: the same measure is then KL(pi_{v-1} || pi_v) of the last update,
        # on its own samples, plus the mismatch above (its floor)
        prev, measured = logprob_mismatch(prox_lp, batch.behav_logprobs, batch.versions, batch.loss_mask,
                                          self.policy_version - 1)
        acc.add({"kl_prev": prev["logprob_mismatch_kl"]}, measured)
        acc.add({"kl_prev_frac": measured / max(1, tokens)}, tokens)

    def _logprobs(self, batch: Batch) -> torch.Tensor:
        """[B, L-1] log-probs of the batch's trained tokens under the current weights."""
        with self._autocast():
            return self._score(batch.input_ids, *self._layout(batch), score_mask(batch))

    def _logprobs_entropy(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`_logprobs` and [B, L-1] the policy's entropy at the same positions, from the same logits."""
        with self._autocast():
            return self._score(batch.input_ids, *self._layout(batch), score_mask(batch), entropy=True)

    def _layout(self, batch: Batch) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(attention_mask, position_ids) of `token_logprobs`: packed rows pass only the positions."""
        return (None, batch.position_ids) if self.packed else (batch.attention_mask, None)

    def _score(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, position_ids: torch.Tensor | None,
               score: torch.Tensor | None, entropy: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The policy's forward: `token_logprobs` (a sharded backend runs its root module instead)."""
        return token_logprobs(self.model, input_ids, attention_mask, self.temperature, score_mask=score,
                              position_ids=position_ids, entropy=entropy)

    def _probe_batch(self, trajs: list[Trajectory]) -> Batch:
        """`trajs` as one micro-batch in this trainer's layout on its device (the KL probe's; nothing trained)."""
        return collate(trajs, torch.zeros(len(trajs)), list(range(len(trajs))), packed=self.packed).to(self.device)

    # Seams for data-parallel backends (trainer/backends/): which micro-batches this process
    # runs, and how its token-weighted stats combine with the other processes'.
    def _shares(self, trajs: list[Trajectory], adv: torch.Tensor, plans: list[Minibatch]) -> list[Share]:
        """What this process runs of each minibatch (a data-parallel backend sends the other ranks theirs)."""
        return [Share(total=mb.tokens, micros=[self._collate(trajs, adv, mb, idx).to(self.device) for idx in mb.micros],
                      tokens=[sum(trained_tokens(trajs[i]) for i in idx) for idx in mb.micros]) for mb in plans]

    def _collate(self, trajs: list[Trajectory], adv: torch.Tensor, mb: Minibatch, index: list[int]) -> Batch:
        """`trajs[i] for i in index` as one micro-batch of minibatch `mb`, in this trainer's layout, on the CPU."""
        agg = partial(self.loss_agg, tokens=mb.tokens, seqs=mb.seqs, norm_tokens=self.cfg.loss_agg_tokens)
        return collate(trajs, adv, index, packed=self.packed, loss_agg=agg)

    def _stats_result(self, acc: StatsAccumulator) -> dict[str, float]:
        return acc.result()

    def _autocast(self):
        """bf16 compute with fp32 master weights when the compute dtype is bfloat16."""
        if self.compute_dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.compute_dtype)

    def _clip_grads(self) -> float:
        max_norm = self.cfg.grad_clip if self.cfg.grad_clip > 0 else float("inf")
        return float(torch.nn.utils.clip_grad_norm_(self.params, max_norm))

    def _plan(self, trajs: list[Trajectory]) -> list[Minibatch]:
        """Minibatches (a seeded random split of the trajectories), each cut into micro-batches."""
        n = min(self.cfg.minibatches, len(trajs))
        order = self._rng.permutation(len(trajs)) if n > 1 else np.arange(len(trajs))
        return [plan_minibatch(trajs, [int(i) for i in chunk], self.cfg.micro_batch_tokens,
                               self.cfg.micro_batch_overhead_tokens, packed=self.packed)
                for chunk in np.array_split(order, n)]

    @torch.no_grad()
    def _prox_logprobs(self, shares: list[Share]) -> list[list[torch.Tensor]]:
        """Log-probs of every micro-batch under the weights at the start of the step."""
        return [[self._logprobs(b) for b in share.micros] for share in shares]

    @torch.no_grad()
    def _ref_logprobs(self, shares: list[Share]) -> list[list[torch.Tensor]]:
        """Log-probs of every micro-batch under the reference weights (trainer.kl_coef)."""
        def score(b: Batch) -> torch.Tensor:
            mask, positions = self._layout(b)
            return token_logprobs(self.ref_model, b.input_ids, mask, self.temperature, score_mask=score_mask(b),
                                  position_ids=positions)
        with self._autocast():
            return [[score(b) for b in share.micros] for share in shares]

    def _frozen_copy(self, model: torch.nn.Module) -> torch.nn.Module:
        """A copy of `model` that never trains, in the compute dtype: one more model in memory (half
        of an fp32 copy under bf16 autocast), which is why trainer.kl_coef is off by default."""
        ref = copy.deepcopy(model).to(self.compute_dtype).eval()
        for p in ref.parameters():
            p.requires_grad_(False)
        return ref

