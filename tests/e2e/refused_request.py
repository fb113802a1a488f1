"""Test-only: imported into a run through `agent.modules` with `rollout.agent=too_long`, a single-turn agent whose
prompt, for about one sample in seven, is longer than the model's context: the generation server refuses those
requests (one per-request error each). A run with it must finish its steps, say so, and the audit must count
the prompts it could not train (`tests/e2e/test_breakage.py`). Never part of a real run."""

import dataclasses
import zlib

from async_rl.agent import register_agent_loop
from async_rl.agent.single_turn import SingleTurnAgentLoop

NAME = "too_long"


def too_long_on_some(sample) -> bool:
    return zlib.crc32(sample.id.encode()) % 7 == 0


@register_agent_loop(NAME)
class TooLongPromptLoop(SingleTurnAgentLoop):
    async def run(self, sample, sampling_params, *, group_id):
        if too_long_on_some(sample):
            sample = dataclasses.replace(sample, prompt="1+" * 200 + (sample.prompt or ""))
        return await super().run(sample, sampling_params, group_id=group_id)
