"""Trajectories -> padded model inputs, micro-batches by token budget, and token log-probs.

Everything is laid out over next-token positions: column j of a [B, L-1] tensor is about
the token at position j+1, predicted from the logits at position j. A response token k
of a trajectory with a P-token prompt sits in column P-1+k. Micro-batches are formed by
sorting on length so that padding stays small; packing without padding can replace
`micro_batches` later without touching the trainer.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from async_rl.types import Trajectory


@dataclass
class Batch:
    input_ids: torch.Tensor  # [B, L] int64, right-padded with 0
    attention_mask: torch.Tensor  # [B, L]
    loss_mask: torch.Tensor  # [B, L-1] 1 where the target token was sampled by the model
    behav_logprobs: torch.Tensor  # [B, L-1]
    versions: torch.Tensor  # [B, L-1] int64, -1 where not trained
    advantages: torch.Tensor  # [B, L-1]
    index: list[int]  # positions of these rows in the trajectory list

    @property
    def num_tokens(self) -> int:
        return int(self.loss_mask.sum())


def collate(trajs: list[Trajectory], advantages: torch.Tensor, index: list[int]) -> Batch:
    """Pad the trajectories `index` of `trajs` into one Batch; `advantages` is [len(trajs)]."""
    rows = [trajs[i] for i in index]
    L = max(len(t.prompt_ids) + len(t.response_ids) for t in rows)
    B = len(rows)
    input_ids = torch.zeros(B, L, dtype=torch.long)
    attn = torch.zeros(B, L, dtype=torch.long)
    loss_mask = torch.zeros(B, L - 1)
    behav = torch.zeros(B, L - 1)
    versions = torch.full((B, L - 1), -1, dtype=torch.long)
    adv = torch.zeros(B, L - 1)
    for b, t in enumerate(rows):
        p, r = len(t.prompt_ids), len(t.response_ids)
        input_ids[b, :p] = torch.from_numpy(t.prompt_ids.astype(np.int64))
        input_ids[b, p:p + r] = torch.from_numpy(t.response_ids.astype(np.int64))
        attn[b, :p + r] = 1
        cols = slice(p - 1, p - 1 + r)
        m = torch.from_numpy(t.loss_mask.astype(np.float32))
        loss_mask[b, cols] = m
        behav[b, cols] = torch.from_numpy(t.behav_logprobs.astype(np.float32)) * m
        versions[b, cols] = torch.from_numpy(t.versions.astype(np.int64))
        adv[b, cols] = advantages[index[b]] * m
    return Batch(input_ids, attn, loss_mask, behav, versions, adv, list(index))


def micro_batches(trajs: list[Trajectory], token_budget: int) -> list[list[int]]:
    """Split trajectory indices into groups whose padded size (rows x longest) fits `token_budget`."""
    order = sorted(range(len(trajs)), key=lambda i: len(trajs[i].prompt_ids) + len(trajs[i].response_ids))
    out: list[list[int]] = []
    cur: list[int] = []
    for i in order:
        length = len(trajs[i].prompt_ids) + len(trajs[i].response_ids)
        if cur and (len(cur) + 1) * length > token_budget:
            out.append(cur)
            cur = []
        cur.append(i)
    if cur:
        out.append(cur)
    return out


def token_logprobs(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                   temperature: float) -> torch.Tensor:
    """Log-prob of each next token under log_softmax(logits / temperature), in fp32: [B, L-1]."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits[:, :-1]  # [B, L-1, V]
    logits = logits.float()
    if temperature > 0 and temperature != 1.0:
        logits = logits / temperature
    targets = input_ids[:, 1:]
    picked = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)
