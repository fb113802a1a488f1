"""Token log-probs of a micro-batch under a causal LM: the decoder once, the LM head only where scored.

    lp = token_logprobs(model, input_ids, attention_mask, temperature, score_mask=loss_mask)   # padded rows
    lp = token_logprobs(model, input_ids, None, temperature, position_ids=pos, score_mask=...)  # packed rows

Columns follow batching.py: column j of a [B, L-1] result is the token at position j+1,
predicted from the logits at position j.

`token_logprobs` runs the decoder once, then applies the LM head only at the scored
positions, a chunk of rows at a time in float32. Under autograd each chunk is
checkpointed, so a [tokens, vocab] logits tensor never outlives its chunk (the vocab is
49152 for SmolLM2); the price is a second LM-head matmul per chunk in backward.

Packed rows (several sequences back to back in one row, `position_ids` restarting at 0 for
each) need attention that is causal within a sequence and absent across sequences. Hugging
Face transformers (5.x, `masking_utils.create_causal_mask`) builds exactly that mask from
the position ids when the 2-D attention mask is None AND there is no KV cache
(`find_packed_sequence_indices`: a new sequence wherever a position does not follow the
previous one by 1), for the sdpa, eager and flex paths; flash-attention derives its
cu_seqlens from the same position ids. So a packed call passes `attention_mask=None` and
`use_cache=False` (with a cache, or with any 2-D mask, the sequences would attend to each
other). Llama (the tiny test model, SmolLM2) goes through that function;
`packing_error` checks any other model on a probe before the trainer relies on it. That mask
is dense over the row, though (T^2 scores for sum(n^2) that count): an sdpa model's packed row
goes through packed_attention.py instead, each sequence attending to itself alone.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from async_rl.trainer.packed_attention import packed_attention

# config attributes of heads that are more than a plain linear layer: fall back to full logits
_SPECIAL_HEAD_ATTRS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


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


def _pick(logits: torch.Tensor, targets: torch.Tensor, inv_temp: float, entropy: bool = False) -> torch.Tensor:
    """logits [n, V] (any dtype), targets [n] -> [n] float32 log-probs of the targets; with `entropy`,
    [n, 2]: the log-probs and, detached, the entropy of each position's distribution (the same
    temperature), from the logits already in hand (no second forward)."""
    logits = logits.float()
    if inv_temp != 1.0:
        logits = logits * inv_temp
    lse = torch.logsumexp(logits, dim=-1)  # [n]
    picked = logits.gather(-1, targets[:, None])[:, 0] - lse
    if not entropy:
        return picked
    with torch.no_grad():
        # H = logsumexp(z) - sum_v p_v z_v
        ent = lse - (torch.softmax(logits, dim=-1) * logits).sum(dim=-1)
    return torch.stack([picked, ent.detach()], dim=-1)


def _chunk_logprobs(hidden: torch.Tensor, targets: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                    inv_temp: float, entropy: bool = False) -> torch.Tensor:
    """hidden [n, H], targets [n] -> [n] (with `entropy`: [n, 2], see `_pick`); the matmul runs in the
    model's dtype, like the engine's."""
    return _pick(F.linear(hidden, weight, bias), targets, inv_temp, entropy)


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


def token_logprobs(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                   temperature: float, *, score_mask: torch.Tensor | None = None,
                   position_ids: torch.Tensor | None = None, chunk_tokens: int = 1024,
                   entropy: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """[B, L-1] float32: log p(input_ids[:, j+1] | its sequence up to j) under log_softmax(logits / temperature).
    With `entropy`, a pair: those log-probs and [B, L-1] the entropy of the policy's next-token
    distribution at the same positions (detached; 0 where not scored).

    Padded rows: `attention_mask` [B, L], 1 on real tokens, right-padded. Packed rows:
    `attention_mask` None and `position_ids` [B, L] restarting at 0 for every sequence (see
    the module docstring). temperature 0 (greedy) or 1 means plain log_softmax. Only positions
    where `score_mask` [B, L-1] is nonzero are computed (default: every real next token of the
    same sequence); the others are 0. Differentiable when grad is enabled.
    """
    B, L = input_ids.shape
    if attention_mask is None and position_ids is None:
        raise ValueError("token_logprobs: give attention_mask (padded rows) or position_ids (packed rows)")
    if score_mask is None:
        real = attention_mask[:, 1:] if attention_mask is not None else torch.ones_like(input_ids[:, 1:])
        score_mask = real if position_ids is None else real * (position_ids[:, 1:] != 0)
    if score_mask.shape != (B, L - 1):
        raise ValueError(f"score_mask: expected shape {(B, L - 1)}, got {tuple(score_mask.shape)}")
    inv_temp = 1.0 if temperature in (0.0, 1.0) else 1.0 / temperature
    rows, cols = score_mask.nonzero(as_tuple=True)  # [N] each
    targets = input_ids[:, 1:][rows, cols]  # [N]
    inputs = dict(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False)
    packed = position_ids if attention_mask is None else None
    split = _plain_head(model)
    with packed_attention(getattr(model, "config", None), packed) as extra:
        if split is None:
            logits = model(**inputs, **extra).logits
            picked = _pick(logits[:, :-1][rows, cols], targets, inv_temp, entropy)  # [N] or [N, 2]
        else:
            decoder, head = split
            hidden = decoder(**inputs, **extra).last_hidden_state
            h = hidden[:, :-1][rows, cols]  # [N, H]
            picked = chunked_logprobs(_chunk_logprobs, h, targets, head.weight, head.bias, inv_temp, entropy,
                                      chunk_tokens=chunk_tokens)
    out = torch.zeros(B, L - 1, dtype=torch.float32, device=input_ids.device)
    if not entropy:
        return out.index_put((rows, cols), picked)
    picked = picked.reshape(-1, 2)  # no scored position: [0] from chunked_logprobs
    ent = torch.zeros(B, L - 1, dtype=torch.float32, device=input_ids.device)
    return out.index_put((rows, cols), picked[:, 0]), ent.index_put((rows, cols), picked[:, 1].detach())


def probe_sequences(vocab: int) -> list[list[int]]:
    """Two short sequences of token ids below `vocab`, for `packing_error`."""
    top = max(2, min(vocab, 64))
    return [[1 + (7 * i) % (top - 1) for i in range(5)], [1 + (11 * i + 3) % (top - 1) for i in range(7)]]


@torch.no_grad()
def packing_error(score: Callable[..., torch.Tensor], vocab: int) -> float:
    """Largest |log-prob| gap between two probe sequences scored packed in one row and scored as padded rows.

    `score(input_ids, attention_mask, position_ids)` -> [B, L-1] log-probs (every real next token):
    the trainer's own forward, so an FSDP-sharded model is probed as it trains. A model whose
    attention does not honour packed position ids (a 2-D mask it always builds, a KV cache it
    always makes) leaks one sequence into the other: the gap is then of order 0.1, float noise
    is 1e-6."""
    seqs = probe_sequences(vocab)
    L = max(map(len, seqs))
    ids = torch.zeros(len(seqs), L, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, s in enumerate(seqs):
        ids[b, :len(s)], mask[b, :len(s)] = torch.tensor(s), 1
    padded = score(ids, mask, None)
    packed = score(torch.tensor([sum(seqs, [])]), None, torch.tensor([[i for s in seqs for i in range(len(s))]]))[0]
    gap, start = 0.0, 0
    for b, s in enumerate(seqs):
        n = len(s) - 1
        gap = max(gap, float((packed[start:start + n].cpu() - padded[b, :n].cpu()).abs().max()))
        start += len(s)
    return gap
