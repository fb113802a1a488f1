"""Greedy accuracy of the current policy on a fixed held-out set, through the generation servers."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from async_rl.agent.single_turn import prompt_ids_for
from async_rl.protocols import GenerationClient
from async_rl.types import Sample, SamplingParams


async def evaluate(clients: list[GenerationClient], tokenizer: Any, task: Any, samples: list[Sample],
                   max_new_tokens: int, max_concurrent: int = 64) -> dict[str, float]:
    """Fraction of `samples` answered exactly right by greedy decoding."""
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0)
    slots = asyncio.Semaphore(max_concurrent)

    async def one(i: int, sample: Sample) -> tuple[float, int, list[int]]:
        async with slots:
            out = await clients[i % len(clients)].generate(prompt_ids_for(tokenizer, sample), params)
        text = tokenizer.decode(out.output_ids, skip_special_tokens=True)
        return task.reward(sample, text), len(out.output_ids), list(out.output_versions)

    t0 = time.perf_counter()
    results = await asyncio.gather(*(one(i, s) for i, s in enumerate(samples)))
    n = max(len(results), 1)
    versions = [v for _, _, vs in results for v in vs]
    return {"eval/accuracy": sum(r for r, _, _ in results) / n, "eval/n": len(results),
            "eval/response_len_mean": sum(l for _, l, _ in results) / n, "eval/seconds": time.perf_counter() - t0,
            "eval/version_min": min(versions, default=-1), "eval/version_max": max(versions, default=-1)}
