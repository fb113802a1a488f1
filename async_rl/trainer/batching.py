"""Trajectories -> padded model inputs, micro-batches by token budget, and token log-probs.

Everything per token is laid out over next-token positions: column j of a [B, L-1]
tensor is about the token at position j+1, predicted from the logits at position j.
Response token k of a trajectory with a P-token prompt sits in column P-1+k; prompt
columns and padding hold zeros (versions -1) and loss_mask 0. Micro-batches are formed
by sorting on length so padding stays small; packing without padding can replace
`micro_batches` + `collate` later without touching the trainer. A `Batch` is a TensorDict
(tensorclass): device moves, row shares and shipping between trainer ranks come with it.
`micro_batches` stays plain Python on purpose: it cuts trajectories before they are padded,
which a padded TensorDict, all of one length, cannot express.

`token_logprobs` runs the decoder once, then applies the LM head only at the scored
positions, a chunk of rows at a time in float32. Under autograd each chunk is
checkpointed, so a [tokens, vocab] logits tensor never outlives its chunk (the vocab is
49152 for SmolLM2); the price is a second LM-head matmul per chunk in backward.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F
from tensordict import tensorclass
from torch.utils.checkpoint import checkpoint

from async_rl.trainer.advantages import broadcast_to_tokens
from async_rl.types import Trajectory

# config attributes of heads that are more than a plain linear layer: fall back to full logits
_SPECIAL_HEAD_ATTRS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


@tensorclass
class Batch:
    """One padded micro-batch, a TensorDict of B rows: `batch.to(device)`, `batch[rows]` (a row
    share), and `send`/`recv` over a process group (trainer/backends/spmd.py) come with it."""

    input_ids: torch.Tensor  # [B, L] int64, prompt + response, right-padded with 0
    attention_mask: torch.Tensor  # [B, L] int64, 1 on real tokens
    loss_mask: torch.Tensor  # [B, L-1] float32, 1 where the target token was sampled by the model
    behav_logprobs: torch.Tensor  # [B, L-1] float32, 0 where not trained
    versions: torch.Tensor  # [B, L-1] int64, -1 where not trained
    advantages: torch.Tensor  # [B, L-1] float32, 0 where not trained
    # [B, L-1] float32: each trained token's weight in its minibatch's loss (trainer.loss_agg); collate
    # gives a token mean over this batch alone, the trainer replaces it with the minibatch's
    loss_weights: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return int(self.loss_mask.sum())

    @classmethod
    def empty(cls, rows: int, length: int, device: torch.device | str = "cpu") -> "Batch":
        """A batch of this shape to receive into (the dtypes `collate` makes)."""
        long, flt = dict(dtype=torch.long, device=device), dict(dtype=torch.float32, device=device)
        return cls(input_ids=torch.zeros(rows, length, **long), attention_mask=torch.zeros(rows, length, **long),
                   loss_mask=torch.zeros(rows, length - 1, **flt), behav_logprobs=torch.zeros(rows, length - 1, **flt),
                   versions=torch.zeros(rows, length - 1, **long), advantages=torch.zeros(rows, length - 1, **flt),
                   loss_weights=torch.zeros(rows, length - 1, **flt), batch_size=[rows], device=device)


def seq_len(traj: Trajectory) -> int:
    return len(traj.prompt_ids) + len(traj.response_ids)


def collate(trajs: list[Trajectory], advantages: torch.Tensor, index: list[int]) -> Batch:
    """Pad trajectories `trajs[i] for i in index` into one Batch; `advantages` is [len(trajs)]."""
    rows = [trajs[i] for i in index]
    for i, t in zip(index, rows):
        if len(t.prompt_ids) == 0:
            raise ValueError(f"trajectory {t.id} (#{i}): prompt_ids is empty; the first response token "
                             "needs at least one prompt token to be predicted from")
    B, L = len(rows), max(seq_len(t) for t in rows)
    input_ids = torch.zeros(B, L, dtype=torch.long)
    attention_mask = torch.zeros(B, L, dtype=torch.long)
    loss_mask = torch.zeros(B, L - 1)
    behav = torch.zeros(B, L - 1)
    versions = torch.full((B, L - 1), -1, dtype=torch.long)
    for b, t in enumerate(rows):
        p, r = len(t.prompt_ids), len(t.response_ids)
        input_ids[b, :p] = torch.from_numpy(t.prompt_ids.astype(np.int64))
        input_ids[b, p:p + r] = torch.from_numpy(t.response_ids.astype(np.int64))
        attention_mask[b, :p + r] = 1
        cols = slice(p - 1, p - 1 + r)
        m = torch.from_numpy(t.loss_mask.astype(bool))
        loss_mask[b, cols] = m.float()
        behav[b, cols] = torch.where(m, torch.from_numpy(t.behav_logprobs.astype(np.float32)), 0.0)
        versions[b, cols] = torch.where(m, torch.from_numpy(t.versions.astype(np.int64)), -1)
    adv = broadcast_to_tokens(advantages[index].to(torch.float32), loss_mask)
    return Batch(input_ids=input_ids, attention_mask=attention_mask, loss_mask=loss_mask, behav_logprobs=behav,
                 versions=versions, advantages=adv, loss_weights=loss_mask / loss_mask.sum().clamp(min=1),
                 batch_size=[B])


def micro_batches(trajs: list[Trajectory], token_budget: int, overhead_tokens: int = 0) -> list[list[int]]:
    """Split indices of `trajs` into micro-batches of padded size (rows x longest) within
    `token_budget`, with the fewest padded tokens plus `overhead_tokens` per micro-batch.

    A micro-batch costs its padded tokens and a fixed overhead (one more forward and backward).
    With long-tailed lengths one long response pads a whole batch to its length: 30 responses of
    8 tokens and 2 of 70 are 2240 padded tokens in one micro-batch, 380 in two. Over the
    trajectories sorted by length, a dynamic programme picks the cut points that minimise
    padded tokens + overhead x micro-batches (ties go to fewer micro-batches). A trajectory
    longer than the budget gets a micro-batch of its own.
    """
    if token_budget <= 0:
        raise ValueError(f"trainer.micro_batch_tokens: must be > 0, got {token_budget}")
    if overhead_tokens < 0:
        raise ValueError(f"trainer.micro_batch_overhead_tokens: must be >= 0, got {overhead_tokens}")
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


def _plain_head(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Linear] | None:
    """(decoder, lm_head) when logits are exactly lm_head(decoder(...)), else None."""
    config = getattr(model, "config", None)
    if any(getattr(config, a, None) not in (None, 1, 1.0) for a in _SPECIAL_HEAD_ATTRS):
        return None
    get_dec, get_head = getattr(model, "get_decoder", None), getattr(model, "get_output_embeddings", None)
    if get_dec is None or get_head is None:
        return None
    decoder, head = get_dec(), get_head()
    if decoder is None or decoder is model or not isinstance(head, torch.nn.Linear):
        return None
    return decoder, head


def _pick(logits: torch.Tensor, targets: torch.Tensor, inv_temp: float) -> torch.Tensor:
    """logits [n, V] (any dtype), targets [n] -> [n] float32 log-probs of the targets."""
    logits = logits.float()
    if inv_temp != 1.0:
        logits = logits * inv_temp
    return logits.gather(-1, targets[:, None])[:, 0] - torch.logsumexp(logits, dim=-1)


def _chunk_logprobs(hidden: torch.Tensor, targets: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                    inv_temp: float) -> torch.Tensor:
    """hidden [n, H], targets [n] -> [n]; the matmul runs in the model's dtype, like the engine's."""
    return _pick(F.linear(hidden, weight, bias), targets, inv_temp)


def chunked_logprobs(pick: Callable[..., torch.Tensor], hidden: torch.Tensor, targets: torch.Tensor, *args,
                     chunk_tokens: int = 1024) -> torch.Tensor:
    """[N] float32: `pick(hidden[s:e], targets[s:e], *args)` over chunks of rows of hidden [N, H].
    Under autograd each chunk is checkpointed, so its [chunk, vocab] logits never outlive it."""
    parts = []
    for s in range(0, hidden.shape[0], chunk_tokens):
        chunk = (hidden[s:s + chunk_tokens], targets[s:s + chunk_tokens], *args)
        if torch.is_grad_enabled() and hidden.requires_grad:
            parts.append(checkpoint(pick, *chunk, use_reentrant=False))
        else:
            parts.append(pick(*chunk))
    return torch.cat(parts) if parts else hidden.new_zeros(0, dtype=torch.float32)


def token_logprobs(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                   temperature: float, *, score_mask: torch.Tensor | None = None,
                   chunk_tokens: int = 1024) -> torch.Tensor:
    """[B, L-1] float32: log p(input_ids[:, j+1] | input_ids[:, :j+1]) under log_softmax(logits / temperature).

    temperature 0 (greedy) or 1 means plain log_softmax. Only positions where
    `score_mask` [B, L-1] is nonzero are computed (default: every real next token); the
    others are 0. Differentiable when grad is enabled.
    """
    B, L = input_ids.shape
    if score_mask is None:
        score_mask = attention_mask[:, 1:]
    if score_mask.shape != (B, L - 1):
        raise ValueError(f"score_mask: expected shape {(B, L - 1)}, got {tuple(score_mask.shape)}")
    inv_temp = 1.0 if temperature in (0.0, 1.0) else 1.0 / temperature
    rows, cols = score_mask.nonzero(as_tuple=True)  # [N] each
    targets = input_ids[:, 1:][rows, cols]  # [N]
    split = _plain_head(model)
    if split is None:
        logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
        picked = _pick(logits[:, :-1][rows, cols], targets, inv_temp)  # [N]
    else:
        decoder, head = split
        hidden = decoder(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
        h = hidden[:, :-1][rows, cols]  # [N, H]
        picked = chunked_logprobs(_chunk_logprobs, h, targets, head.weight, head.bias, inv_temp,
                                  chunk_tokens=chunk_tokens)
    out = torch.zeros(B, L - 1, dtype=torch.float32, device=input_ids.device)
    return out.index_put((rows, cols), picked)

