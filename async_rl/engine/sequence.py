"""One state object per request inside the engine: tokens, KV bookkeeping, sampled outputs.

A `Sequence` holds every token of its request (prompt + sampled output) and how many of
them already have their KV in the paged cache (`num_computed`). One rule drives prefill,
chunked prefill, decode and recompute alike: a step computes a chunk of the tokens after
`num_computed`; when the chunk reaches the last token, the step samples the next one.
Preemption and weight updates only reset `num_computed` (and free the blocks); the next
chunks recompute the KV, and sampling continues where it stopped.
"""

from __future__ import annotations

import enum

import torch

from async_rl.types import GenerationOutput, SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # in the waiting queue: new, preempted, or interrupted by a weight update
    RUNNING = "running"  # holds KV blocks and is scheduled every step
    FINISHED = "finished"


class Sequence:
    """A request's tokens and state. `token_ids` = prompt + output; KV exists for the first `num_computed`."""

    __slots__ = (
        "request_id", "params", "prompt_len", "token_ids", "output_logprobs", "output_versions",
        "output_top_logprobs", "status", "finish_reason", "num_computed", "block_table", "block_hashes",
        "num_interruptions", "prefix_cached_tokens", "admitted_once", "recompute_left", "generator",
        "stop_ids", "kv_mixed",
    )

    def __init__(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                 eos_token_ids: frozenset[int], device: torch.device):
        self.request_id = request_id
        self.params = params
        self.prompt_len = len(prompt_ids)
        self.token_ids: list[int] = list(prompt_ids)
        self.output_logprobs: list[float] = []
        self.output_versions: list[int] = []
        self.output_top_logprobs: list[list[tuple[int, float]]] | None = [] if params.top_logprobs else None
        self.status = SequenceStatus.WAITING
        self.finish_reason: str | None = None
        self.num_computed = 0  # tokens whose KV is in the cache
        self.block_table: list[int] = []  # KV block ids, one per block_size tokens
        self.block_hashes: list[int] = []  # chained hash of each full block of token_ids, in order
        self.num_interruptions = 0
        self.prefix_cached_tokens = 0  # prefix-cache hit on first admission (reported to the caller)
        self.admitted_once = False
        self.recompute_left = 0  # tokens computed before a preemption/interruption, to be computed again
        # its KV was kept across a weight update (pause mode in_place): part of it comes from older weights,
        # so none of its blocks is offered to the prefix cache until it is recomputed
        self.kv_mixed = False
        self.generator: torch.Generator | None = None
        if params.seed is not None:
            self.generator = torch.Generator(device=device)
            self.generator.manual_seed(params.seed)
        stop = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop |= eos_token_ids
        self.stop_ids = frozenset(stop)

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len:]

    @property
    def num_output(self) -> int:
        return len(self.token_ids) - self.prompt_len

    def reset_kv(self) -> None:
        """Forget the KV state (the caller frees the blocks); the next chunks recompute it."""
        self.recompute_left = max(self.recompute_left, self.num_computed)
        self.num_computed = 0
        self.kv_mixed = False
        self.block_table = []
        self.block_hashes = []

    def to_output(self) -> GenerationOutput:
        return GenerationOutput(
            request_id=self.request_id,
            prompt_len=self.prompt_len,
            output_ids=list(self.output_ids),
            output_logprobs=list(self.output_logprobs),
            output_versions=list(self.output_versions),
            finish_reason=self.finish_reason or "abort",
            num_interruptions=self.num_interruptions,
            output_top_logprobs=None if self.output_top_logprobs is None else list(self.output_top_logprobs),
            prefix_cached_tokens=self.prefix_cached_tokens,
        )
