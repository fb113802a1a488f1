"""Policy losses as pure functions: tensors in, `(loss, stats)` out, no I/O.

The decoupled PPO objective (AReaL) separates the behaviour policy that sampled a token
(pi_behav, possibly several versions old, mixed within one response after a weight
update) from the proximal policy the update is anchored to (pi_prox, the weights at
the start of this train step):

    loss_t = - w_t * min(r_t * A_t, clip(r_t, 1 - eps, 1 + eps) * A_t)
    r_t = pi_theta / pi_prox,   w_t = min(pi_prox / pi_behav, cap)   (w detached)

averaged over trained tokens (loss_mask == 1). Variants register in `LOSSES` under a
name and share the signature of `decoupled_ppo_loss`.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

# exp() of a log-ratio beyond this overflows float32 on the way to a finite answer; the
# clamp only touches tokens whose ratio is already far outside any clip range.
_MAX_LOG_RATIO = 20.0


def decoupled_ppo_loss(logprobs: torch.Tensor, prox_logprobs: torch.Tensor, behav_logprobs: torch.Tensor,
                       advantages: torch.Tensor, loss_mask: torch.Tensor, *, eps_clip: float,
                       behav_weight_cap: float) -> tuple[torch.Tensor, dict[str, float]]:
    """Token-mean decoupled PPO loss over `loss_mask` tokens, and its stats.

    All tensors are [B, T]; only `logprobs` carries gradient. Positions where loss_mask
    is 0 contribute nothing (value or gradient), whatever the other tensors hold there.
    Stats (plain floats): clip_frac, ratio_mean, approx_kl (k3 estimate of
    KL(prox || theta)), behav_weight_mean / behav_weight_max (before the cap),
    behav_capped_frac.
    """
    if eps_clip <= 0:
        raise ValueError(f"eps_clip: must be > 0, got {eps_clip}")
    if behav_weight_cap <= 0:
        raise ValueError(f"behav_weight_cap: must be > 0, got {behav_weight_cap}")
    shape = logprobs.shape
    for name, t in (("prox_logprobs", prox_logprobs), ("behav_logprobs", behav_logprobs),
                    ("advantages", advantages), ("loss_mask", loss_mask)):
        if t.shape != shape:
            raise ValueError(f"{name}: shape {tuple(t.shape)} differs from logprobs {tuple(shape)}")
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
    weight = torch.exp(log_w.clamp(max=math.log(behav_weight_cap)))  # [B, T] capped pi_prox / pi_behav
    loss = -torch.where(mask, weight * surrogate, zero).sum() / n

    with torch.no_grad():
        raw_w = torch.exp(log_w.clamp(max=50.0))  # finite even for absurd gaps, for the stats only
        stats = {
            "clip_frac": float(((unclipped > clipped) & mask).sum() / n),
            "ratio_mean": float(torch.where(mask, ratio, zero).sum() / n),
            "approx_kl": float(torch.where(mask, (ratio - 1.0) - log_ratio, zero).sum() / n),
            "behav_weight_mean": float(torch.where(mask, raw_w, zero).sum() / n),
            "behav_weight_max": float(raw_w[mask].max()) if bool(mask.any()) else 0.0,
            "behav_capped_frac": float(((log_w > math.log(behav_weight_cap)) & mask).sum() / n),
        }
    return loss, stats


def no_behav_correction_loss(logprobs: torch.Tensor, prox_logprobs: torch.Tensor, behav_logprobs: torch.Tensor,
                             advantages: torch.Tensor, loss_mask: torch.Tensor, *, eps_clip: float,
                             behav_weight_cap: float) -> tuple[torch.Tensor, dict[str, float]]:
    """The decoupled loss with the behaviour-policy correction switched off (w_t = 1): stale tokens
    count as if the current weights had sampled them. An ablation, to show what the correction buys."""
    loss, stats = decoupled_ppo_loss(logprobs, prox_logprobs, prox_logprobs, advantages, loss_mask,
                                     eps_clip=eps_clip, behav_weight_cap=behav_weight_cap)
    return loss, stats


LossFn = Callable[..., tuple[torch.Tensor, dict[str, float]]]

# Variants by name (`trainer.loss`); each takes the arguments of `decoupled_ppo_loss`.
LOSSES: dict[str, LossFn] = {"decoupled_ppo": decoupled_ppo_loss, "no_behav_correction": no_behav_correction_loss}


def get_loss(name: str) -> LossFn:
    if name not in LOSSES:
        raise ValueError(f"trainer.loss: unknown loss {name!r} (available: {', '.join(sorted(LOSSES))})")
    return LOSSES[name]
