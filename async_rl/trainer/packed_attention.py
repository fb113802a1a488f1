"""Attention of a packed row, sequence by sequence: what makes a packed micro-batch cost its tokens.

    with packed_attention(model.config, positions) as extra:   # sdpa models; others keep their own path
        model(input_ids=row, position_ids=positions, use_cache=False, **extra)

transformers alone keeps packed sequences apart (masking_utils.create_causal_mask, see
logprobs.py), but for sdpa and eager it does so with a dense [T, T] mask over the whole row: the
attention then computes all T^2 scores of the row and throws most away (a micro-batch of 64
sequences of ~60 tokens: T^2 = 15M scores for ~230k that count), and sdpa with a mask cannot use
its causal kernels. Measured on CPU (benchmarks/packing.py --quick) that made a packed step 3.7x
slower than the padded one.

Here the row's query, key and value are split at the sequence boundaries and each piece goes
through transformers' own `sdpa_attention_forward` with no mask (its causal kernel): the
scores computed are sum(n_i^2), as if each sequence ran alone, and no mask is built. The
function is registered in transformers' AttentionInterface; `packed_attention` switches a
model's `config._attn_implementation` to it for one call and back (it is never saved in a
checkpoint), only where the model runs sdpa. flash-attention models already take packed rows as
varlen (cu_seqlens from the position ids); eager and flex keep transformers' mask.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

NAME = "async_rl_packed_sdpa"
_REPLACES = "sdpa"


def _packed_sdpa(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attention_mask: torch.Tensor | None, *, packed_seq_lens: list[int] | None = None,
                 **kwargs: Any) -> tuple[torch.Tensor, None]:
    """query [1, H, T, D], key / value [1, H_kv, T, D] -> [1, T, H, D]: each sequence of `packed_seq_lens`
    attends causally to itself only."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if packed_seq_lens is None or query.shape[0] != 1:
        raise ValueError(f"{NAME}: needs one packed row and its packed_seq_lens (got {query.shape[0]} rows, "
                         f"lengths {packed_seq_lens})")
    parts = [sdpa_attention_forward(module, q, k, v, None, **kwargs)[0]
             for q, k, v in zip(query.split(packed_seq_lens, dim=2), key.split(packed_seq_lens, dim=2),
                                value.split(packed_seq_lens, dim=2))]
    return torch.cat(parts, dim=1), None


def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, _packed_sdpa)


def seq_lens(position_ids: torch.Tensor) -> list[int]:
    """Lengths of the sequences of one packed row [1, T] (a new one wherever a position is 0): one host read."""
    starts = [i for i, first in enumerate((position_ids[0] == 0).tolist()) if first]
    return [b - a for a, b in zip(starts, starts[1:] + [position_ids.shape[1]])]


@contextlib.contextmanager
def packed_attention(config: Any, position_ids: torch.Tensor | None) -> Iterator[dict[str, Any]]:
    """While open, a model with `config` that runs sdpa attends within each packed sequence of the row
    `position_ids` [1, T] only. Yields the extra keyword arguments of the model call ({}: nothing switched,
    for a model that does not run sdpa, or rows that are not one packed row)."""
    if position_ids is None or position_ids.shape[0] != 1 or getattr(config, "_attn_implementation", None) != _REPLACES:
        yield {}
        return
    _register()
    lens = seq_lens(position_ids)
    config._attn_implementation = NAME
    try:
        yield {"packed_seq_lens": lens}
    finally:
        config._attn_implementation = _REPLACES
