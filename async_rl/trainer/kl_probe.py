"""KL of the current policy to the one the trainer started from, on a small fixed probe: no reference model.

    probe = KlProbe(seqs=2)
    probe.capture(trajs, version, collate, score)   # first step: keep a few responses the start weights sampled
    stats = probe.measure(score)                    # after each update: {"train/kl_init": ...}

A KL penalty (`trainer.kl_coef`) keeps a frozen copy of the initial weights and scores every batch
with it; without one, nothing on a train step knows the initial policy's log-probs of today's
tokens. The probe keeps instead `seqs` responses that the starting weights sampled (the first
step's trajectories, one per prompt, every token of the starting version) with the trainer's
log-probs of them under those weights. After each update one forward (no backward) of those few
sequences gives

    kl_init = mean over the probe's tokens of exp(d) - 1 - d,   d = log pi_now - log pi_start

the k3 estimate of KL(pi_start || pi_now), unbiased because pi_start sampled the tokens. Its cost
is a forward of `seqs` short sequences a step, timed as `timing/kl_probe_s`: the demo's default 2
of ~57 tokens beside a batch of 32 trained forward and backward is about 1/50 of the step (4 of
them measured 1.5-8% of the step's time on a loaded 2-core EPYC, 2.5% median). The starting weights
are those this trainer process began with: after a resume, the checkpoint's.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from async_rl.trainer.batching import Batch
from async_rl.types import Trajectory

Score = Callable[[Batch], torch.Tensor]  # a micro-batch -> [B, L-1] log-probs of its trained tokens
Collate = Callable[[list[Trajectory]], Batch]


def k3_mean(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, mask: torch.Tensor) -> float:
    """Mean over `mask` of exp(d) - 1 - d with d = logprobs - ref_logprobs ([B, T] each): the k3
    estimate of KL(ref || current) on tokens the reference sampled."""
    keep = mask.bool()
    d = torch.where(keep, (logprobs - ref_logprobs).double(), 0.0)
    return float((torch.expm1(d) - d).sum() / keep.sum().clamp(min=1))


class KlProbe:
    def __init__(self, seqs: int):
        if seqs < 0:
            raise ValueError(f"trainer.kl_probe_seqs: must be >= 0, got {seqs}")
        self.seqs = seqs
        self.batch: Batch | None = None
        self.start_logprobs: torch.Tensor | None = None  # [B, L-1] under the starting weights

    @property
    def ready(self) -> bool:
        return self.batch is not None

    def capture(self, trajs: list[Trajectory], version: int, collate: Collate, score: Score) -> None:
        """Keep up to `seqs` of `trajs` sampled wholly by `version` (the weights now), one per group, and
        their log-probs under these weights. Does nothing once captured, or when none qualifies."""
        if self.ready or self.seqs == 0:
            return
        picked, groups = [], set()
        for t in trajs:
            sampled = t.versions[t.loss_mask.astype(bool)]
            if t.group_id in groups or not len(sampled) or (sampled != version).any():
                continue
            groups.add(t.group_id)
            picked.append(t)
            if len(picked) == self.seqs:
                break
        if not picked:
            return
        self.batch = collate(picked)
        with torch.no_grad():
            self.start_logprobs = score(self.batch).detach()

    def measure(self, score: Score) -> dict[str, float]:
        """`train/kl_init` of the weights now (empty before a probe is captured)."""
        if not self.ready:
            return {}
        with torch.no_grad():
            now = score(self.batch)
        return {"train/kl_init": k3_mean(now, self.start_logprobs, self.batch.loss_mask)}
