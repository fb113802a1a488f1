"""Trajectories -> micro-batches of model inputs: padded rows or packed rows, and where to cut them.

Everything per token is laid out over next-token positions: column j of a [B, L-1]
tensor is about the token at position j+1, predicted from the logits at position j.
Response token k of a trajectory with a P-token prompt sits P-1+k columns after its
first column; prompt columns and padding hold zeros (versions -1) and loss_mask 0.

Two layouts of the same micro-batch (`collate(..., packed=)`):

- padded: a row per trajectory, right-padded to the longest (`attention_mask` 1 on real
  tokens). A micro-batch costs rows x longest tokens, so `micro_batches` sorts by length
  and cuts where that saves padding.
- packed: ONE row holding every trajectory's tokens back to back (sum of lengths, no
  padding), `position_ids` restarting at 0 for each, attention block-diagonal (causal
  within a trajectory, none across: logprobs.py). The column after a trajectory's last
  token predicts the next trajectory's first token: a prompt column, never trained or
  scored. A micro-batch costs its tokens, so `micro_batches` fills a token budget.

The loss, its weights, advantages and stats are per token and masked, so they do not see
the layout. A `Batch` is a TensorDict (tensorclass): device moves, row shares and shipping
between trainer ranks come with it. `micro_batches` stays plain Python on purpose: it cuts
trajectories before they are collated, which a TensorDict, all of one length, cannot express.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import torch
from tensordict import tensorclass
from torch.nn.utils.rnn import pad_sequence

from async_rl.trainer.advantages import broadcast_to_tokens
from async_rl.types import Trajectory

# per-column fields of a Batch and what fills a column that is not a trajectory's (padding, boundaries)
_COLUMNS = {"loss_mask": 0.0, "behav_logprobs": 0.0, "versions": -1, "advantages": 0.0, "loss_weights": 0.0}


@tensorclass
class Batch:
    """One micro-batch, a TensorDict of B rows (padded: a row per trajectory; packed: one row):
    `batch.to(device)`, `batch[rows]`, and `send`/`recv` over a process group
    (trainer/backends/spmd.py) come with it."""

    input_ids: torch.Tensor  # [B, L] int64, prompt + response; padded rows right-padded with 0
    attention_mask: torch.Tensor  # [B, L] int64, 1 on real tokens (all 1 when packed)
    position_ids: torch.Tensor  # [B, L] int64, each token's position in its own trajectory (padding: its column)
    loss_mask: torch.Tensor  # [B, L-1] float32, 1 where the target token was sampled by the model
    behav_logprobs: torch.Tensor  # [B, L-1] float32, 0 where not trained
    versions: torch.Tensor  # [B, L-1] int64, -1 where not trained
    advantages: torch.Tensor  # [B, L-1] float32, 0 where not trained
    # [B, L-1] float32: each trained token's weight in its minibatch's loss (trainer.loss_agg); by default
    # a token mean over this batch alone
    loss_weights: torch.Tensor

    @property
    def num_tokens(self) -> int:
        """Trained tokens (reads the mask: a device sync on GPU; the trainer counts them on the host)."""
        return int(self.loss_mask.sum())

    @classmethod
    def empty(cls, rows: int, length: int, device: torch.device | str = "cpu") -> "Batch":
        """A batch of this shape to receive into (the dtypes `collate` makes)."""
        long, flt = dict(dtype=torch.long, device=device), dict(dtype=torch.float32, device=device)
        cols = {k: torch.zeros(rows, length - 1, **(long if k == "versions" else flt)) for k in _COLUMNS}
        return cls(input_ids=torch.zeros(rows, length, **long), attention_mask=torch.zeros(rows, length, **long),
                   position_ids=torch.zeros(rows, length, **long), **cols, batch_size=[rows], device=device)


def seq_len(traj: Trajectory) -> int:
    return len(traj.prompt_ids) + len(traj.response_ids)


def trained_tokens(traj: Trajectory) -> int:
    return int(np.count_nonzero(traj.loss_mask))


# a minibatch's aggregation (trainer.loss_agg, its totals bound): loss_mask [1, T] of one trajectory -> weights [1, T]
LossAgg = Callable[[torch.Tensor], torch.Tensor]


def _columns(t: Trajectory, advantage: torch.Tensor, loss_agg: LossAgg | None) -> dict[str, torch.Tensor]:
    """One trajectory's per-column tensors, [len - 1] each; `advantage` is [1] or [1, trained tokens]."""
    p, r = len(t.prompt_ids), len(t.response_ids)
    m = torch.from_numpy(t.loss_mask.astype(bool))

    def place(values: torch.Tensor, fill: float | int, dtype: torch.dtype) -> torch.Tensor:
        out = torch.full((p - 1 + r,), fill, dtype=dtype)
        out[p - 1:] = values
        return out

    loss_mask = place(m.float(), 0.0, torch.float32)
    out = {"loss_mask": loss_mask,
           "behav_logprobs": place(torch.where(m, torch.from_numpy(t.behav_logprobs.astype(np.float32)), 0.0), 0.0,
                                   torch.float32),
           "versions": place(torch.where(m, torch.from_numpy(t.versions.astype(np.int64)), -1), -1, torch.long),
           "advantages": broadcast_to_tokens(advantage.to(torch.float32), loss_mask[None])[0]}
    out["loss_weights"] = loss_agg(loss_mask[None])[0] if loss_agg is not None else loss_mask
    return out


def collate(trajs: list[Trajectory], advantages: torch.Tensor, index: list[int], *, packed: bool = False,
            loss_agg: LossAgg | None = None) -> Batch:
    """Trajectories `trajs[i] for i in index` as one micro-batch, padded rows or one packed row.

    `advantages` is [len(trajs)] (or [len(trajs), trained tokens]). `loss_agg` maps one
    trajectory's loss_mask [1, T] to its tokens' weights in the minibatch's loss (trainer.loss_agg
    with the minibatch's totals bound), called per trajectory, so it sees each trajectory as a
    row whatever the layout; without it, a token mean over this micro-batch.
    """
    rows = [trajs[i] for i in index]
    for i, t in zip(index, rows):
        if len(t.prompt_ids) == 0:
            raise ValueError(f"trajectory {t.id} (#{i}): prompt_ids is empty; the first response token "
                             "needs at least one prompt token to be predicted from")
    ids = [torch.from_numpy(np.concatenate([t.prompt_ids, t.response_ids]).astype(np.int64)) for t in rows]
    cols = [_columns(t, advantages[i:i + 1], loss_agg) for i, t in zip(index, rows)]
    batch = _packed(ids, cols) if packed else _padded(ids, cols)
    if loss_agg is None:
        batch.loss_weights = batch.loss_mask / batch.loss_mask.sum().clamp(min=1)
    return batch


def _padded(ids: list[torch.Tensor], cols: list[dict[str, torch.Tensor]]) -> Batch:
    B, L = len(ids), max(len(x) for x in ids)
    real = [torch.ones(len(x), dtype=torch.long) for x in ids]
    tensors = {k: pad_sequence([c[k] for c in cols], batch_first=True, padding_value=fill)
               for k, fill in _COLUMNS.items()}
    return Batch(input_ids=pad_sequence(ids, batch_first=True), attention_mask=pad_sequence(real, batch_first=True),
                 position_ids=torch.arange(L).repeat(B, 1), **tensors, batch_size=[B])


def _packed(ids: list[torch.Tensor], cols: list[dict[str, torch.Tensor]]) -> Batch:
    T = sum(len(x) for x in ids)
    tensors = {}
    for k, fill in _COLUMNS.items():  # each trajectory's columns, then its boundary column (dropped after the last)
        boundary = torch.full((1,), fill, dtype=cols[0][k].dtype)
        tensors[k] = torch.cat([part for c in cols for part in (c[k], boundary)])[:T - 1][None]
    return Batch(input_ids=torch.cat(ids)[None], attention_mask=torch.ones(1, T, dtype=torch.long),
                 position_ids=torch.cat([torch.arange(len(x)) for x in ids])[None], **tensors, batch_size=[1])


def micro_batches(trajs: list[Trajectory], token_budget: int, overhead_tokens: int = 0, *,
                  packed: bool = False) -> list[list[int]]:
    """Split indices of `trajs` into micro-batches that fit `token_budget` (padded: rows x longest;
    packed: the sum of lengths), each a forward + backward that costs `overhead_tokens` more.

    Packed, every cut trains the same tokens, so the fewest micro-batches win: first-fit over
    the trajectories longest first. Padded, one long response pads a whole micro-batch to its
    length: 30 responses of 8 tokens and 2 of 70 are 2240 padded tokens in one micro-batch, 380
    in two. Over the trajectories sorted by length, a dynamic programme picks the cut points that
    minimise padded tokens + overhead x micro-batches (ties go to fewer micro-batches). Either
    way a trajectory longer than the budget gets a micro-batch of its own.
    """
    if token_budget <= 0:
        raise ValueError(f"trainer.micro_batch_tokens: must be > 0, got {token_budget}")
    if overhead_tokens < 0:
        raise ValueError(f"trainer.micro_batch_overhead_tokens: must be >= 0, got {overhead_tokens}")
    if packed:
        return _first_fit(trajs, token_budget)
    order = sorted(range(len(trajs)), key=lambda i: seq_len(trajs[i]))
    lens = [seq_len(trajs[i]) for i in order]
    best = [0.0] + [math.inf] * len(lens)  # best[j]: least cost of the first j (sorted) trajectories
    cut = [0] * (len(lens) + 1)  # where the last micro-batch of that best split starts
    for j in range(1, len(lens) + 1):
        longest, i = lens[j - 1], j - 1
        while True:  # the last micro-batch is order[i:j]; it grows while it fits the budget
            cost = best[i] + (j - i) * longest + overhead_tokens
            if cost <= best[j]:
                best[j], cut[j] = cost, i
            if i == 0 or (j - i + 1) * longest > token_budget:
                break
            i -= 1
    out: list[list[int]] = []
    j = len(lens)
    while j > 0:
        out.append(order[cut[j]:j])
        j = cut[j]
    return out[::-1]


def _first_fit(trajs: list[Trajectory], token_budget: int) -> list[list[int]]:
    """First-fit decreasing: each trajectory, longest first, joins the first micro-batch it fits."""
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(trajs)), key=lambda i: -seq_len(trajs[i])):
        n = seq_len(trajs[i])
        k = next((k for k, left in enumerate(room) if n <= left), None)
        if k is None:
            bins.append([i])
            room.append(token_budget - n)
        else:
            bins[k].append(i)
            room[k] -= n
    return bins
