"""What one train step trains, decided on the host before any tensor is built: minibatches, their
micro-batches (trajectory indices), and what each process runs of them (`Share`).

    plan = plan_minibatch(trajs, index, token_budget, overhead_tokens, packed=True)
    plan.micros   # [[3, 0, 7], [5, 1]]: trajectory indices of each micro-batch
    plan.tokens   # trained tokens of the minibatch (its token_mean divisor), plan.seqs its trained sequences

Every count here comes from the trajectories' numpy arrays, so weighing a micro-batch's stats or
deciding to skip one never reads a tensor back from the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from async_rl.trainer.batching import Batch, micro_batches, trained_tokens
from async_rl.types import Trajectory


@dataclass(slots=True)
class Minibatch:
    """One optimizer step's trajectories, cut into micro-batches."""

    micros: list[list[int]]  # trajectory indices of each micro-batch that trains a token
    tokens: int  # trained tokens of the minibatch
    seqs: int  # its trajectories with a trained token


def plan_minibatch(trajs: list[Trajectory], index: list[int], token_budget: int, overhead_tokens: int, *,
                   packed: bool) -> Minibatch:
    """`trajs[i] for i in index` as micro-batches within `token_budget` (batching.micro_batches)."""
    sub = [trajs[i] for i in index]
    cuts = micro_batches(sub, token_budget, overhead_tokens, packed=packed)
    micros = [[index[j] for j in cut] for cut in cuts]
    counts = [trained_tokens(t) for t in sub]
    return Minibatch(micros=[m for m in micros if any(trained_tokens(trajs[i]) for i in m)], tokens=sum(counts),
                     seqs=sum(1 for n in counts if n))


@dataclass(slots=True)
class Share:
    """A process's part of one minibatch: its micro-batches (each token weighted by its part of the
    minibatch's loss, `Batch.loss_weights`), the trained tokens of each (counted on the host), and
    the minibatch's trained-token count (0: no step)."""

    total: int
    micros: list[Batch]
    tokens: list[int]


def score_mask(batch: Batch) -> torch.Tensor:
    """[B, L-1] positions to compute log-probs at: the trained tokens. A share with none (a data-parallel
    rank's idle row, weighted 0) scores its first position, so the backward still reaches every weight.
    Chosen on the device: no host read."""
    first = torch.zeros_like(batch.loss_mask)
    first[0, 0] = 1.0
    return torch.where(batch.loss_mask.any(), batch.loss_mask, first)
