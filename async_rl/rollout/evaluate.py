"""Greedy accuracy of the current policy on the task's held-out set, through the generation servers.

Each held-out sample runs as one greedy episode (temperature 0) of its own agent loop
(`sample.agent`, else `rollout.agent`), with the run's tools and simulated users: a multi-turn
task is evaluated the way it is trained (tool calls run, users answer), not as one turn. A
sample counts as solved when its episode earns the full reward (1); `eval/reward_mean` is the
mean reward, which differs from the accuracy only for partial scores (an interaction's 0.5 for
a second try). A problem the server refuses to generate for (a prompt too long for its context) is
unsolved, and counted (`eval/refused`).

A task with a validation set (`task.val_size`) has it evaluated beside the test set, in the same
call: `eval/val_accuracy`, `eval/val_reward_mean`, `eval/val_n` (the run's best checkpoint is
chosen on it; `eval/accuracy` stays the test set's, which nothing is chosen on). The evaluation
before training skips it: the starting weights are no candidate.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

from async_rl.agent import AgentContext, as_trajectory, build_agent_loop
from async_rl.config import Config
from async_rl.protocols import GenerationClient
from async_rl.types import RequestRefused, Sample, SamplingParams


async def evaluate(clients: list[GenerationClient], tokenizer: Any, task: Any, samples: list[Sample],
                   max_new_tokens: int, max_concurrent: int = 64, *, agent: str = "single_turn",
                   context: AgentContext | None = None) -> dict[str, float]:
    """Fraction of `samples` solved by greedy episodes (`max_new_tokens` per model turn); `agent` is
    the loop of samples that name none, `context` the run's tools and interactions."""
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0)
    slots = asyncio.Semaphore(max_concurrent)

    async def one(i: int, sample: Sample) -> tuple[float, int, list[int], bool]:
        loop = build_agent_loop(sample.agent or agent, clients[i % len(clients)], tokenizer, task.reward, context)
        async with slots:
            try:
                traj = as_trajectory(await loop.run(sample, params, group_id=f"eval-{i}"), f"eval-{i}", sample)
            except RequestRefused:  # the server will not answer this problem (too long a prompt): unsolved
                return 0.0, 0, [], True
        sampled = traj.loss_mask.astype(bool)
        return traj.reward, int(sampled.sum()), [int(v) for v in traj.versions[sampled]], False

    t0 = time.perf_counter()
    results = await asyncio.gather(*(one(i, s) for i, s in enumerate(samples)))
    n = max(len(results), 1)
    versions = [v for _, _, vs, _ in results for v in vs]
    return {"eval/accuracy": sum(r >= 1.0 for r, _, _, _ in results) / n,
            "eval/refused": sum(refused for *_, refused in results),
            "eval/reward_mean": sum(r for r, _, _, _ in results) / n, "eval/n": len(results),
            "eval/response_len_mean": sum(l for _, l, _, _ in results) / n, "eval/seconds": time.perf_counter() - t0,
            "eval/version_min": min(versions, default=-1), "eval/version_max": max(versions, default=-1)}


@dataclass
class Evaluation:
    """What every evaluation of a run shares: the held-out set, the clients, agent loops and limits."""

    clients: list[GenerationClient]
    tokenizer: Any
    task: Any
    context: AgentContext | None
    max_new_tokens: int
    max_concurrent: int
    agent: str = "single_turn"

    def __post_init__(self) -> None:
        self.samples = self.task.eval_samples()
        self.val_samples = self.task.val_samples() if hasattr(self.task, "val_samples") else []

    @classmethod
    def for_run(cls, cfg: Config, clients: list[GenerationClient], tokenizer: Any, task: Any,
                context: AgentContext | None) -> "Evaluation":
        return cls(clients, tokenizer, task, context, cfg.rollout.eval_max_new_tokens, cfg.rollout.max_concurrent,
                   cfg.rollout.agent)

    async def run(self, validation: bool = True) -> dict[str, float]:
        """Evaluate the policy the servers hold now, on the test set and (where there is one, and `validation`)
        the validation set."""
        def on(samples: list[Sample]):
            return evaluate(self.clients, self.tokenizer, self.task, samples, self.max_new_tokens,
                            self.max_concurrent, agent=self.agent, context=self.context)
        if not self.val_samples or not validation:
            return await on(self.samples)
        test, val = await asyncio.gather(on(self.samples), on(self.val_samples))
        return {**test, "eval/val_accuracy": val["eval/accuracy"], "eval/val_reward_mean": val["eval/reward_mean"],
                "eval/val_n": val["eval/n"], "eval/version_min": min(test["eval/version_min"], val["eval/version_min"]),
                "eval/version_max": max(test["eval/version_max"], val["eval/version_max"])}
