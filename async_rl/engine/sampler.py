"""Turn a step's logits into tokens: greedy, temperature, top-k, top-p, min-p, penalties, per-request seeds.

The log-prob rule. The log-prob reported for a sampled token (and every top-logprob) is
the one the trainer recomputes from the same weights: `log_softmax(logits / temperature)[token]`
over the FULL vocabulary, from the UNPENALISED logits; for greedy rows (temperature 0) it
is `log_softmax(logits)[token]`. Everything else only shapes the distribution a token is
drawn from, never the reported probability:
- top-k, top-p and min-p restrict which tokens can be drawn;
- `frequency_penalty` (minus penalty x count in the output so far), `presence_penalty`
  (minus penalty once a token is in the output), `repetition_penalty` (a logit of a token
  already in the output is divided by it when positive, multiplied when negative) and
  `logit_bias` are applied to the raw logits before the temperature, as SGLang does;
  penalties look at the output tokens only, not the prompt;
- before `min_new_tokens` tokens exist, the request's stop tokens (EOS included) cannot be drawn.
RL needs exactly this: the behaviour log-prob is compared with the policy's own log-prob
of the token (the decoupled-PPO importance weight), so it must be a log-prob of the policy,
not of a distribution the trainer cannot reproduce. A run that samples with penalties
trains on tokens the policy would draw less often; the importance weight then corrects
nothing for the penalty, which is the caller's choice to make.

A draw is an inverse-CDF lookup of one uniform number per row, so a row's draw depends
only on its own number: a seeded request takes it from its own `torch.Generator` and
samples the same tokens whatever else shares the batch. One number per token (not one per
vocabulary entry) also keeps sampling cheap next to the forward pass. Where the engine has a compiled
draw (`kernel`: async_rl/engine/bf16_kernels.py `sample`) a batch whose rows have no penalty, bias or
truncation takes it: the same rule (the same uniform number per row, the inverse CDF over the vocabulary
in order, the log-probs of the full softmax) in one pass instead of a handful of torch ops over [S, V].
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Protocol

import torch

from async_rl.types import SamplingParams


class SamplingState(Protocol):
    """What penalties need to know about a row's request (an engine `Sequence` is one)."""

    @property
    def output_ids(self) -> list[int]: ...

    stop_ids: frozenset[int]


@dataclass(slots=True)
class SampleResult:
    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]] | None]


class Sampler:
    def __init__(self, device: torch.device, seed: int | None = None, kernel=None):
        self.device = device
        self.kernel = kernel  # (logits, inv_t, u) -> (tokens, logprobs, lse) for plain rows, or None
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed if seed is not None else torch.initial_seed() % (1 << 62))

    def __call__(self, logits: torch.Tensor, params: list[SamplingParams],
                 generators: list[torch.Generator | None],
                 states: Seq[SamplingState] | None = None) -> SampleResult:
        """logits: [S, V] float32, one row per sampling sequence; `states` are needed by penalised rows."""
        rows, vocab = logits.shape
        if self.kernel is not None and logits.device.type == "cpu" and all(_plain(p, vocab) for p in params):
            return self._compiled(logits, params, generators)
        greedy = [p.temperature == 0.0 for p in params]
        inv_t = [1.0 if g else 1.0 / p.temperature for g, p in zip(greedy, params)]
        scaled = logits
        if any(t != 1.0 for t in inv_t):
            scaled = logits * torch.tensor(inv_t, dtype=logits.dtype, device=logits.device)[:, None]  # [S, V]
        top_logit, tokens = scaled.max(dim=-1)  # [S]; the argmax is what greedy rows keep
        weights = torch.sub(scaled, top_logit[:, None]).exp_()  # [S, V] unnormalised policy probabilities
        lse = top_logit + weights.sum(dim=-1).log()  # log-normaliser of every row (the reported log-probs)
        drawn_from, weights = self._penalise(logits, scaled, weights, params, states, inv_t)
        if drawn_from is not scaled and any(greedy):
            tokens = drawn_from.argmax(dim=-1)
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

    def _compiled(self, logits: torch.Tensor, params: list[SamplingParams],
                  generators: list[torch.Generator | None]) -> SampleResult:
        inv_t = torch.tensor([0.0 if p.temperature == 0.0 else 1.0 / p.temperature for p in params])
        drawn = [i for i, p in enumerate(params) if p.temperature != 0.0]
        u = torch.zeros(len(params))
        if drawn:
            u[drawn] = self._uniforms([generators[i] for i in drawn])
        tokens, logprobs, lse = self.kernel(logits, inv_t, u)
        top: list[list[tuple[int, float]] | None] = [None] * len(params)
        k = max(p.top_logprobs for p in params)
        if k:
            scale = torch.where(inv_t > 0, inv_t, torch.ones_like(inv_t))[:, None]
            vals, ids = (logits * scale).topk(k, dim=-1)
            vals, ids = (vals - lse[:, None]).tolist(), ids.tolist()
            for i, p in enumerate(params):
                if p.top_logprobs:
                    top[i] = list(zip(ids[i][:p.top_logprobs], vals[i][:p.top_logprobs]))
        return SampleResult(tokens.tolist(), logprobs.tolist(), top)

    def _penalise(self, logits: torch.Tensor, scaled: torch.Tensor, weights: torch.Tensor,
                  params: list[SamplingParams], states: Seq[SamplingState] | None,
                  inv_t: list[float]) -> tuple[torch.Tensor, torch.Tensor]:
        """The logits tokens are drawn from [S, V] and their unnormalised probabilities [S, V]:
        `scaled` and `weights` themselves unless some row has penalties, a bias or min_new_tokens."""
        rows = [i for i, p in enumerate(params) if p.penalised]
        if not rows:
            return scaled, weights
        if states is None:
            raise ValueError("sampling_params: penalties, logit_bias and min_new_tokens need the request state")
        drawn_from, weights = scaled.clone(), weights.clone()
        for i in rows:
            row = self._adjust(logits[i].clone(), params[i], states[i]) * inv_t[i]  # [V]
            drawn_from[i] = row
            weights[i] = torch.exp(row - row.max())
        return drawn_from, weights

    @staticmethod
    def _adjust(row: torch.Tensor, p: SamplingParams, state: SamplingState) -> torch.Tensor:
        """One row's raw logits [V] after penalties, logit bias and the min_new_tokens mask."""
        vocab = row.shape[0]
        out = state.output_ids
        if out and (p.frequency_penalty or p.presence_penalty or p.repetition_penalty != 1.0):
            counts = torch.bincount(torch.tensor(out, device=row.device), minlength=vocab)[:vocab].to(row.dtype)
            seen = counts > 0
            if p.repetition_penalty != 1.0:
                row = torch.where(seen & (row < 0), row * p.repetition_penalty,
                                  torch.where(seen, row / p.repetition_penalty, row))
            row = row - p.frequency_penalty * counts - p.presence_penalty * seen.to(row.dtype)
        if p.logit_bias:
            ids = [t for t in p.logit_bias if t < vocab]
            if ids:
                row[ids] += torch.tensor([p.logit_bias[t] for t in ids], dtype=row.dtype, device=row.device)
        if len(out) < p.min_new_tokens:
            stop = [t for t in state.stop_ids if t < vocab]
            if stop and len(stop) < vocab:
                row[stop] = float("-inf")
        return row

    def _uniforms(self, generators: list[torch.Generator | None]) -> torch.Tensor:
        """One U[0, 1) number per row; seeded rows draw from their own generator. [R]"""
        u = torch.rand(len(generators), generator=self.generator, device=self.device)
        for i, gen in enumerate(generators):
            if gen is not None:
                u[i] = torch.rand(1, generator=gen, device=self.device)[0]
        return u

    @staticmethod
    def _truncate(probs: torch.Tensor, params: list[SamplingParams], vocab: int) -> torch.Tensor:
        """Zero the (unnormalised) probabilities outside each row's top-k / top-p / min-p set. [R, V]"""
        top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
        top_p = [p.top_p for p in params]
        min_p = [p.min_p for p in params]
        if all(k == vocab for k in top_k) and all(p >= 1.0 for p in top_p):
            if not any(min_p):
                return probs
            floor = torch.tensor(min_p, dtype=probs.dtype, device=probs.device)[:, None]  # no sort needed
            return probs.masked_fill(probs < floor * probs.max(dim=-1, keepdim=True).values, 0.0)
        sorted_probs, order = probs.sort(dim=-1, descending=True)  # [R, V]
        ranks = torch.arange(vocab, device=probs.device)[None, :]
        drop = ranks >= torch.tensor(top_k, device=probs.device)[:, None]
        kept = sorted_probs.masked_fill(drop, 0.0)
        before = (kept.cumsum(dim=-1) - kept) / kept.sum(dim=-1, keepdim=True)  # mass of more likely tokens
        drop |= before >= torch.tensor(top_p, device=probs.device)[:, None]
        if any(min_p):
            floor = torch.tensor(min_p, dtype=probs.dtype, device=probs.device)[:, None] * sorted_probs[:, :1]
            drop |= sorted_probs < floor
        drop[:, 0] = False
        return torch.zeros_like(probs).scatter_(1, order, sorted_probs.masked_fill(drop, 0.0))


def _plain(p: SamplingParams, vocab: int) -> bool:
    """Drawn from the full softmax at its temperature: no penalty, bias, min_new_tokens or truncation."""
    return not p.penalised and not 0 < p.top_k < vocab and p.top_p >= 1.0 and not p.min_p

