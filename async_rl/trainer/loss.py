"""Policy losses as pure functions: tensors in, `(loss, stats)` out, no I/O.

The decoupled PPO objective (AReaL) separates the behaviour policy that sampled a token
(pi_behav, possibly several versions old) from the proximal policy the update is
anchored to (pi_prox, the weights at the start of this train step):

    loss_t = - w_t * min(r_t * A_t, clip(r_t, 1 - eps, 1 + eps) * A_t)
    r_t = pi_theta / pi_prox,   w_t = min(pi_prox / pi_behav, cap)   (w detached)

averaged over trained tokens (loss_mask == 1).
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def decoupled_ppo_loss(logprobs: torch.Tensor, prox_logprobs: torch.Tensor, behav_logprobs: torch.Tensor,
                       advantages: torch.Tensor, loss_mask: torch.Tensor, *, eps_clip: float,
                       behav_weight_cap: float) -> tuple[torch.Tensor, dict[str, float]]:
    """All inputs [B, T]; loss_mask selects trained tokens. Returns the token-mean loss and stats."""
    mask = loss_mask.to(logprobs.dtype)
    n = mask.sum().clamp(min=1.0)
    ratio = torch.exp(logprobs - prox_logprobs)  # [B, T]
    clipped = ratio.clamp(1.0 - eps_clip, 1.0 + eps_clip)
    surrogate = torch.minimum(ratio * advantages, clipped * advantages)
    raw_weight = torch.exp(prox_logprobs - behav_logprobs).detach()
    weight = raw_weight.clamp(max=behav_weight_cap)
    loss = -(weight * surrogate * mask).sum() / n
    with torch.no_grad():
        m = mask.bool()
        clip_hit = ((ratio * advantages) > (clipped * advantages)) & m
        stats = {
            "train/clip_frac": float(clip_hit.sum() / n),
            "train/ratio_mean": float((ratio * mask).sum() / n),
            "train/behav_weight_mean": float((raw_weight * mask).sum() / n),
            "train/behav_weight_max": float(raw_weight[m].max()) if m.any() else 0.0,
            "train/behav_capped_frac": float(((raw_weight > behav_weight_cap) & m).sum() / n),
            "train/approx_kl": float((((ratio - 1) - torch.log(ratio)) * mask).sum() / n),
        }
    return loss, stats


LossFn = Callable[..., tuple[torch.Tensor, dict[str, float]]]
LOSSES: dict[str, LossFn] = {"decoupled_ppo": decoupled_ppo_loss}
