"""A user's own agent loop in its own module, registered on import: `agent.modules=[custom_agent_mod]`
(tests/ on PYTHONPATH). One model turn, the task's reward, and a trace record naming itself, so a
run can show which samples it served."""

from async_rl.agent import AgentLoop, Episode, register_agent_loop
from async_rl.agent.single_turn import prompt_ids_for

NAME = "custom_echo"


@register_agent_loop(NAME)
class CustomEchoLoop(AgentLoop):
    async def run(self, sample, sampling_params, *, group_id):
        ep = Episode(prompt_ids_for(self.tokenizer, sample), max_response_tokens=sampling_params.max_new_tokens)
        out = await self.client.generate(ep.context_ids, sampling_params)
        kept = ep.add_model_turn(out)
        reward = self.reward_fn(sample, self.tokenizer.decode(kept, skip_special_tokens=True))
        if self.context.trace is not None:
            self.context.trace({"sample_id": sample.id, "agent": NAME, "group_id": group_id, "reward": reward,
                                "interaction": sample.info.get("interaction"), "turns": []})
        return ep.output(reward=reward, info={"sample_id": sample.id, "agent": NAME})
