"""Single-turn agent loop: one prompt, one sampled response, one verifiable reward."""

from __future__ import annotations

import time

from async_rl.agent.base import AgentLoop, register_agent_loop
from async_rl.models import chat_prompt_ids
from async_rl.types import Sample, SamplingParams, Trajectory, trajectory_from_generation


def prompt_ids_for(tokenizer, sample: Sample) -> list[int]:
    """Token ids of the sample's prompt: chat messages through the template, or raw text."""
    if sample.messages is not None:
        return chat_prompt_ids(tokenizer, sample.messages)
    if sample.prompt is None:
        raise ValueError(f"sample {sample.id}: has neither prompt nor messages")
    return [int(t) for t in tokenizer.encode(sample.prompt, add_special_tokens=False)]


@register_agent_loop("single_turn")
class SingleTurnAgentLoop(AgentLoop):
    async def run(self, sample: Sample, sampling_params: SamplingParams, *, group_id: str) -> Trajectory:
        prompt_ids = prompt_ids_for(self.tokenizer, sample)
        t0 = time.perf_counter()
        out = await self.client.generate(prompt_ids, sampling_params)
        gen_s = time.perf_counter() - t0
        text = self.tokenizer.decode(out.output_ids, skip_special_tokens=True)
        reward = self.reward_fn(sample, text)
        return trajectory_from_generation(
            group_id=group_id, prompt_ids=prompt_ids, out=out, reward=reward,
            timings={"generate_s": gen_s}, info={"sample_id": sample.id},
        )
