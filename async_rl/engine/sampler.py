"""Turn a step's logits into tokens: greedy, temperature, top-k, top-p, per-request seeds.

The log-prob reported for a sampled token is the one the trainer recomputes:
`log_softmax(logits / temperature)[token]` over the FULL vocabulary (top-k/top-p only
restrict which tokens can be drawn, not the reported probability); for greedy rows
(temperature 0) it is `log_softmax(logits)[token]`. A draw is an inverse-CDF lookup of
one uniform number per row, so a row's draw depends only on its own number: a seeded
request takes it from its own `torch.Generator` and samples the same tokens whatever
else shares the batch. One number per token (not one per vocabulary entry) also keeps
sampling cheap next to the forward pass.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from async_rl.types import SamplingParams


@dataclass(slots=True)
class SampleResult:
    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]] | None]


class Sampler:
    def __init__(self, device: torch.device, seed: int | None = None):
        self.device = device
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed if seed is not None else torch.initial_seed() % (1 << 62))

    def __call__(self, logits: torch.Tensor, params: list[SamplingParams],
                 generators: list[torch.Generator | None]) -> SampleResult:
        """logits: [S, V] float32, one row per sampling sequence."""
        rows, vocab = logits.shape
        greedy = [p.temperature == 0.0 for p in params]
        inv_t = [1.0 if g else 1.0 / p.temperature for g, p in zip(greedy, params)]
        scaled = logits
        if any(t != 1.0 for t in inv_t):
            scaled = logits * torch.tensor(inv_t, dtype=logits.dtype, device=logits.device)[:, None]  # [S, V]
        top_logit, tokens = scaled.max(dim=-1)  # [S]: greedy rows keep the argmax
        weights = torch.exp(scaled - top_logit[:, None])  # [S, V] unnormalised probabilities
        lse = top_logit + weights.sum(dim=-1).log()  # log-normaliser of every row
        sampled_rows = [i for i in range(rows) if not greedy[i]]
        if sampled_rows:
            idx = torch.tensor(sampled_rows, device=logits.device) if len(sampled_rows) < rows else None
            w = weights if idx is None else weights[idx]  # [R, V]
            w = self._truncate(w, [params[i] for i in sampled_rows], vocab)
            cdf = w.cumsum_(dim=-1)
            u = self._uniforms([generators[i] for i in sampled_rows]) * cdf[:, -1]
            drawn = torch.searchsorted(cdf, u[:, None], right=True)[:, 0].clamp_(max=vocab - 1)
            if idx is None:
                tokens = drawn
            else:
                tokens[idx] = drawn
        chosen = scaled.gather(1, tokens[:, None])[:, 0] - lse
        top: list[list[tuple[int, float]] | None] = [None] * rows
        k = max(p.top_logprobs for p in params)
        if k:
            vals, ids = scaled.topk(k, dim=-1)
            vals, ids = (vals - lse[:, None]).tolist(), ids.tolist()
            for i, p in enumerate(params):
                if p.top_logprobs:
                    top[i] = list(zip(ids[i][:p.top_logprobs], vals[i][:p.top_logprobs]))
        return SampleResult(tokens.tolist(), chosen.tolist(), top)

    def _uniforms(self, generators: list[torch.Generator | None]) -> torch.Tensor:
        """One U[0, 1) number per row; seeded rows draw from their own generator. [R]"""
        u = torch.rand(len(generators), generator=self.generator, device=self.device)
        for i, gen in enumerate(generators):
            if gen is not None:
                u[i] = torch.rand(1, generator=gen, device=self.device)[0]
        return u

    @staticmethod
    def _truncate(probs: torch.Tensor, params: list[SamplingParams], vocab: int) -> torch.Tensor:
        """Zero the (unnormalised) probabilities outside each row's top-k / top-p set. [R, V]"""
        top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
        top_p = [p.top_p for p in params]
        if all(k == vocab for k in top_k) and all(p >= 1.0 for p in top_p):
            return probs
        sorted_probs, order = probs.sort(dim=-1, descending=True)  # [R, V]
        ranks = torch.arange(vocab, device=probs.device)[None, :]
        drop = ranks >= torch.tensor(top_k, device=probs.device)[:, None]
        kept = sorted_probs.masked_fill(drop, 0.0)
        before = (kept.cumsum(dim=-1) - kept) / kept.sum(dim=-1, keepdim=True)  # mass of more likely tokens
        drop |= before >= torch.tensor(top_p, device=probs.device)[:, None]
        drop[:, 0] = False
        return torch.zeros_like(probs).scatter_(1, order, sorted_probs.masked_fill(drop, 0.0))
