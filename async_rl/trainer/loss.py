"""Policy losses as pure functions: tensors in, `(loss, stats)` out, no I/O.

The decoupled PPO objective (AReaL) separates the behaviour policy that sampled a token
(pi_behav, possibly several versions old, mixed within one response after a weight
update, and computed by the engine's kernels) from the proximal policy the update is
anchored to (pi_prox, the trainer's log-probs under the weights at the start of this step):

    loss_t = - w_t * min(r_t * A_t, clip(r_t, 1 - eps, 1 + eps) * A_t)
    r_t = pi_theta / pi_prox,   w_t = rule(rho_t),   rho_t = pi_prox / pi_behav   (w detached)

The variants in `LOSSES` (`trainer.loss`) differ only in the behaviour-weight rule, with
c = `trainer.behav_weight_cap`:

- `decoupled_ppo` (the default): truncated importance sampling (TIS), w = min(rho, c);
- `masked_is`: masked importance sampling as AReaL's code does it, w = rho where rho <= c,
  else the token is dropped (w = 0);
- `icepop`: IcePop's two-sided mask (Ring-1T), w = rho where 1/c <= rho <= c, else 0: a token
  the trainer finds far less likely than the engine did is dropped too, not only one it finds
  far more likely;
- `no_behav_correction`: w = 1, stale tokens count as if the current weights had sampled
  them (an ablation, to show what the correction buys).

A dropped token still counts in the aggregation's denominator (as in AReaL): dropping a few
does not scale up the rest.

Aggregation: the loss is sum_t loss_weights_t * loss_t over trained tokens. The trainer takes
`loss_weights` ([B, T]) from `LOSS_AGGS` (`trainer.loss_agg`), computed over the whole
minibatch, so a minibatch's loss is the sum of its micro-batches' parts:

- `token_mean` (the default; DAPO's token-level loss): every trained token of the minibatch
  weighs 1 / (its trained tokens); no per-sequence length normalisation, a long response
  counts by its tokens;
- `seq_mean_token_mean` (the original GRPO): the mean over sequences of each sequence's token
  mean, 1 / (len_i * sequences); a token of a short response weighs more (the length bias
  Dr.GRPO removes);
- `seq_mean_token_sum_norm` (Dr.GRPO): token sums divided by a constant, 1 / (L * sequences)
  with L = `trainer.loss_agg_tokens` (the generation budget); the weight of a token depends on
  nothing else in the batch.

`kl_penalty` is the optional KL term to a reference policy (`trainer.kl_coef`), added to any
loss, with the same aggregation weights.

`logprob_mismatch` measures what no loss can remove: the engine's and the trainer's log-probs
of the same tokens under the SAME weights differ (other kernels, other dtypes, batch-dependent
reductions), so even at eta = 0 pi_prox / pi_behav is not 1.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial

import torch

# exp() of a log-ratio beyond this overflows float32 on the way to a finite answer; the
# clamp only touches tokens whose ratio is already far outside any clip range.
_MAX_LOG_RATIO = 20.0
_STATS_MAX_LOG = 50.0  # finite weights in the stats even for absurd gaps


def _truncate(log_w: torch.Tensor, cap: float) -> torch.Tensor:
    """TIS: every token trains, its weight cut at the cap."""
    return torch.exp(log_w.clamp(max=math.log(cap)))


def _mask_above(log_w: torch.Tensor, cap: float) -> torch.Tensor:
    """Masked IS (AReaL): a token whose weight exceeds the cap is dropped; the others keep their full weight."""
    return torch.where(log_w <= math.log(cap), torch.exp(log_w.clamp(max=_MAX_LOG_RATIO)), 0.0)


def _mask_outside(log_w: torch.Tensor, cap: float) -> torch.Tensor:
    """IcePop: Ring-1T's M(rho; alpha, beta) with alpha = 1/cap, beta = cap (rho kept inside, 0 outside)."""
    if cap < 1.0:
        raise ValueError(f"behav_weight_cap: icepop keeps tokens with weight in [1/c, c], so c must be >= 1, got {cap}")
    return torch.where(log_w.abs() <= math.log(cap), torch.exp(log_w.clamp(max=_MAX_LOG_RATIO)), 0.0)


def _ones(log_w: torch.Tensor, cap: float) -> torch.Tensor:
    """No correction: the stats still report the weights it ignores."""
    return torch.ones_like(log_w)


WeightRule = Callable[[torch.Tensor, float], torch.Tensor]  # (log rho [B, T], cap) -> w [B, T]
# a loss's stats: 0-dim tensors on the loss's device, so a micro-batch never waits for the device to
# report them; the trainer reads them once per step (trainer/stats.py)
Stats = dict[str, torch.Tensor]


def _check(logprobs: torch.Tensor, others: dict[str, torch.Tensor | None]) -> None:
    for name, t in others.items():
        if t is not None and t.shape != logprobs.shape:
            raise ValueError(f"{name}: shape {tuple(t.shape)} differs from logprobs {tuple(logprobs.shape)}")


def _aggregation(loss_weights: torch.Tensor | None, mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[B, T] weight of each token's term: `loss_weights` as given, else a token mean over `mask`."""
    if loss_weights is not None:
        return loss_weights.to(dtype)
    return mask.to(dtype) / mask.sum().clamp(min=1).to(dtype)


def _policy_loss(rule: WeightRule, logprobs: torch.Tensor, prox_logprobs: torch.Tensor,
                 behav_logprobs: torch.Tensor, advantages: torch.Tensor, loss_mask: torch.Tensor, *,
                 eps_clip: float, behav_weight_cap: float,
                 loss_weights: torch.Tensor | None = None) -> tuple[torch.Tensor, Stats]:
    if eps_clip <= 0:
        raise ValueError(f"eps_clip: must be > 0, got {eps_clip}")
    if behav_weight_cap <= 0:
        raise ValueError(f"behav_weight_cap: must be > 0, got {behav_weight_cap}")
    _check(logprobs, {"prox_logprobs": prox_logprobs, "behav_logprobs": behav_logprobs, "advantages": advantages,
                      "loss_mask": loss_mask, "loss_weights": loss_weights})
    mask = loss_mask.bool()  # [B, T]
    n = mask.sum().clamp(min=1).to(logprobs.dtype)
    zero = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)

    log_ratio = torch.where(mask, logprobs - prox_logprobs.detach(), zero).clamp(max=_MAX_LOG_RATIO)
    ratio = torch.exp(log_ratio)  # [B, T] pi_theta / pi_prox
    adv = torch.where(mask, advantages.to(logprobs.dtype), zero)
    unclipped = ratio * adv
    clipped = ratio.clamp(1.0 - eps_clip, 1.0 + eps_clip) * adv
    surrogate = torch.minimum(unclipped, clipped)

    log_w = torch.where(mask, (prox_logprobs - behav_logprobs).detach().to(logprobs.dtype), zero)
    weight = rule(log_w, behav_weight_cap)  # [B, T] the behaviour weight each token trains with
    agg = _aggregation(loss_weights, mask, logprobs.dtype)  # [B, T]
    loss = -torch.where(mask, agg * weight * surrogate, zero).sum()

    with torch.no_grad():
        raw_w = torch.exp(log_w.clamp(max=_STATS_MAX_LOG))  # > 0, so 0 off the mask leaves the max alone
        stats = {
            "clip_frac": ((unclipped > clipped) & mask).sum() / n,
            "ratio_mean": torch.where(mask, ratio, zero).sum() / n,
            "approx_kl": torch.where(mask, (ratio - 1.0) - log_ratio, zero).sum() / n,
            "behav_weight_mean": torch.where(mask, raw_w, zero).sum() / n,
            "behav_weight_max": torch.where(mask, raw_w, zero).max() if mask.numel() else zero,
            "behav_capped_frac": ((log_w > math.log(behav_weight_cap)) & mask).sum() / n,
            "behav_masked_frac": ((weight == 0) & mask).sum() / n,
        }
    return loss, stats


def decoupled_ppo_loss(logprobs: torch.Tensor, prox_logprobs: torch.Tensor, behav_logprobs: torch.Tensor,
                       advantages: torch.Tensor, loss_mask: torch.Tensor, *, eps_clip: float,
                       behav_weight_cap: float,
                       loss_weights: torch.Tensor | None = None) -> tuple[torch.Tensor, Stats]:
    """Decoupled PPO with truncated importance sampling: w = min(pi_prox / pi_behav, cap).

    All tensors are [B, T]; only `logprobs` carries gradient. Positions where loss_mask
    is 0 contribute nothing (value or gradient), whatever the other tensors hold there.
    The loss is sum_t loss_weights_t * loss_t (default: a token mean over loss_mask).
    Stats (0-dim tensors, token means over loss_mask): clip_frac, ratio_mean, approx_kl (k3
    estimate of KL(prox || theta)), behav_weight_mean / behav_weight_max (before the rule),
    behav_capped_frac (weight above the cap), behav_masked_frac (tokens the rule dropped).
    """
    return _policy_loss(_truncate, logprobs, prox_logprobs, behav_logprobs, advantages, loss_mask,
                        eps_clip=eps_clip, behav_weight_cap=behav_weight_cap, loss_weights=loss_weights)


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, loss_mask: torch.Tensor,
               loss_weights: torch.Tensor | None = None) -> tuple[torch.Tensor, Stats]:
    """k3 estimate of KL(pi_theta || pi_ref) per token, exp(ref - theta) - (ref - theta) - 1
    (non-negative, unbiased on tokens pi_theta sampled; GRPO's KL term), summed with
    `loss_weights` (default: a token mean over loss_mask). Gradient through `logprobs` only.
    Stats: ref_kl, the token mean of the estimate."""
    _check(logprobs, {"ref_logprobs": ref_logprobs, "loss_mask": loss_mask, "loss_weights": loss_weights})
    mask = loss_mask.bool()
    n = mask.sum().clamp(min=1).to(logprobs.dtype)
    zero = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    d = torch.where(mask, ref_logprobs.detach().to(logprobs.dtype) - logprobs, zero).clamp(-_MAX_LOG_RATIO,
                                                                                         _MAX_LOG_RATIO)
    k3 = torch.exp(d) - d - 1.0  # [B, T]
    agg = _aggregation(loss_weights, mask, logprobs.dtype)
    loss = torch.where(mask, agg * k3, zero).sum()
    return loss, {"ref_kl": torch.where(mask, k3, zero).detach().sum() / n}


def logprob_mismatch(prox_logprobs: torch.Tensor, behav_logprobs: torch.Tensor, versions: torch.Tensor,
                     loss_mask: torch.Tensor, version: int) -> tuple[Stats, torch.Tensor]:
    """Engine vs trainer log-probs of the trained tokens that `version` sampled, `prox_logprobs`
    being the trainer's under that same version's weights: (stats, tokens measured).

    With d = prox - behav = log(pi_trainer / pi_engine) per token: logprob_mismatch_mean (mean
    |d|), logprob_mismatch_max (max |d|), logprob_mismatch_kl (k3 estimate of KL(engine ||
    trainer), mean of exp(d) - 1 - d, unbiased since the engine sampled the tokens). All [B, T]
    inputs; tokens of other versions (staleness, not mismatch) are left out. The stats and the
    count are 0-dim tensors (read once per step, not per micro-batch).
    """
    same = loss_mask.bool() & (versions == version)
    n = same.sum()
    with torch.no_grad():
        d = torch.where(same, (prox_logprobs.detach() - behav_logprobs).to(torch.float64), 0.0)  # 0 off `same`
        k3 = torch.exp(d.clamp(max=_STATS_MAX_LOG)) - 1 - d  # 0 where d is 0
        stats = {"logprob_mismatch_mean": d.abs().sum() / n.clamp(min=1),
                 "logprob_mismatch_max": d.abs().max() if d.numel() else d.sum(),
                 "logprob_mismatch_kl": k3.sum() / n.clamp(min=1)}
    return stats, n


LossFn = Callable[..., tuple[torch.Tensor, Stats]]

# Variants by name (`trainer.loss`); each takes the arguments of `decoupled_ppo_loss`.
LOSSES: dict[str, LossFn] = {"decoupled_ppo": decoupled_ppo_loss, "masked_is": partial(_policy_loss, _mask_above),
                             "icepop": partial(_policy_loss, _mask_outside),
                             "no_behav_correction": partial(_policy_loss, _ones)}


def token_mean(loss_mask: torch.Tensor, *, tokens: int, seqs: int, norm_tokens: int) -> torch.Tensor:
    return loss_mask / max(1, tokens)


def seq_mean_token_mean(loss_mask: torch.Tensor, *, tokens: int, seqs: int, norm_tokens: int) -> torch.Tensor:
    return loss_mask / loss_mask.sum(dim=1, keepdim=True).clamp(min=1) / max(1, seqs)


def seq_mean_token_sum_norm(loss_mask: torch.Tensor, *, tokens: int, seqs: int, norm_tokens: int) -> torch.Tensor:
    if norm_tokens < 1:
        raise ValueError(f"trainer.loss_agg_tokens: seq_mean_token_sum_norm divides by it, must be >= 1, got "
                         f"{norm_tokens}")
    return loss_mask / (norm_tokens * max(1, seqs))


# (loss_mask [B, T] of a micro-batch; trained tokens and sequences of its minibatch, the constant
# L) -> [B, T] weights of each token's term in the minibatch loss (`trainer.loss_agg`)
LossAgg = Callable[..., torch.Tensor]
LOSS_AGGS: dict[str, LossAgg] = {"token_mean": token_mean, "seq_mean_token_mean": seq_mean_token_mean,
                                 "seq_mean_token_sum_norm": seq_mean_token_sum_norm}


def get_loss_agg(name: str) -> LossAgg:
    if name not in LOSS_AGGS:
        raise ValueError(f"trainer.loss_agg: unknown aggregation {name!r} (available: {', '.join(sorted(LOSS_AGGS))})")
    return LOSS_AGGS[name]


def get_loss(name: str) -> LossFn:
    if name not in LOSSES:
        raise ValueError(f"trainer.loss: unknown loss {name!r} (available: {', '.join(sorted(LOSSES))})")
    return LOSSES[name]
