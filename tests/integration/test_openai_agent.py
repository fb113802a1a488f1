"""An agent written against the official `openai` client, trained from the tokens the real server sampled.

The agents here drive `openai.AsyncOpenAI` through the loop's in-process session, on a real
`PooledGenerationClient` over an `HttpGenerationClient` to the real embedded server serving the
scripted model (turn 0: two tool calls; turn 1: "The answer is " then "4", "2" as two tokens,
where re-encoding the text gives the single piece "42"). A thin wrapper records what the server
returned for every generate call, so the trajectory can be checked token by token: mask 1
exactly on those ids, with their log-probs and versions (a weight update between the calls
gives the second call's tokens the new version), mask 0 exactly on the tool turns and template
glue; and the trajectory survives the wire codec.
"""

import asyncio
import dataclasses
from types import SimpleNamespace

import numpy as np
import openai
import pytest
import torch
from scripted_model import build_scripted_checkpoint

from async_rl.agent import AgentContext, build_agent_loop
from async_rl.agent.openai_agent import OpenAIAgentLoop
from async_rl.agent.tools.calculator import CalculatorTool
from async_rl.config import AgentConfig, EngineConfig, ModelConfig
from async_rl.engine.client import HttpGenerationClient
from async_rl.models import chat_prompt_ids, load_model, load_tokenizer
from async_rl.rollout.failover import PooledGenerationClient
from async_rl.rollout.server_pool import ServerPool
from async_rl.tool_parsers import build_tool_parser
from async_rl.transport.codec import decode, encode
from async_rl.types import Sample, SamplingParams, Trajectory
from async_rl.launch.serve import BackgroundServer

QUESTION = [{"role": "user", "content": "What is 40+2?"}]
CALCULATOR = CalculatorTool().schema
SAMPLE = Sample(id="s0", messages=QUESTION, answer="42")
PARAMS = SamplingParams(max_new_tokens=64, temperature=1.0, seed=7)


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    torch.set_num_threads(1)
    ckpt = build_scripted_checkpoint(tmp_path_factory.mktemp("scripted"))
    cfg = ModelConfig(name=str(ckpt), dtype="float32")
    tok = load_tokenizer(cfg)
    bg = BackgroundServer.for_model(load_model(cfg, seed=0, tokenizer=tok), tok, EngineConfig(kv_cache_mb=16),
                                    model_name="scripted")
    # the checkpoint directory is what /update_weights_from_disk takes (SGLang loads a directory, not a file)
    yield SimpleNamespace(url=bg.start(), tok=tok, engine=bg.engine, weights=str(ckpt))
    bg.stop()


class Recording:
    """The pooled client, plus a record of every (prompt, output) the server answered."""

    def __init__(self, inner):
        self.inner, self.seen, self.params = inner, [], []

    async def generate(self, input_ids, sampling_params, request_id=None):
        out = await self.inner.generate(input_ids, sampling_params, request_id)
        self.seen.append((list(input_ids), out))
        self.params.append(sampling_params)
        return out


def reward(sample, text):
    return float(text.strip().endswith(sample.answer))


def run_agent(srv, name_or_cls, sample=SAMPLE, agent_cfg=None, between=None, trace=None):
    """Run one episode of an agent on a pooled, sticky client to the real server; (result, recording)."""
    async def main():
        pool = ServerPool([HttpGenerationClient(srv.url)], health_interval_s=60.0)
        try:
            client = Recording(PooledGenerationClient(pool, sticky=True))
            context = AgentContext(config=agent_cfg or AgentConfig(), tool_parser=build_tool_parser("hermes"),
                                   trace=trace)
            agent = build_agent_loop(name_or_cls, client, srv.tok, reward, context) if isinstance(name_or_cls, str) \
                else name_or_cls(client, srv.tok, reward, context)
            agent.between = between
            return await agent.run(sample, PARAMS, group_id="g0"), client
        finally:
            await pool.close()
    return asyncio.run(main())


async def bump_version(srv, version):
    """A weight update (same weights, new version) through the server's own routes."""
    http = HttpGenerationClient(srv.url)
    try:
        await http.pause_generation()
        await http.update_weights_from_disk(srv.weights, version)
        await http.continue_generation()
    finally:
        await http.close()


def test_the_example_agent_trains_exactly_the_sampled_tokens(srv):
    v0 = srv.engine.weight_version
    traces = []
    out, rec = run_agent(srv, "openai_example", trace=traces.append)
    tok = srv.tok
    assert out.reward == 1.0 and out.num_turns == 2 and out.finish_reason == "stop"
    assert out.metrics == {"calls": 2, "chains": 1, "dropped_calls": 0, "tool_calls": 2, "template_breaks": 0}
    assert len(rec.seen) == 2
    (p1, o1), (p2, o2) = rec.seen
    assert out.prompt_ids == p1 == chat_prompt_ids(tok, QUESTION, [CALCULATOR])
    # call 2's prompt is call 1's prompt + its sampled ids + env tokens: nothing re-tokenised
    assert p2[:len(p1) + len(o1.output_ids)] == p1 + o1.output_ids
    env = p2[len(p1) + len(o1.output_ids):]
    assert out.response_ids == o1.output_ids + env + o2.output_ids
    assert out.response_mask == [1] * len(o1.output_ids) + [0] * len(env) + [1] * len(o2.output_ids)
    assert out.behav_logprobs == o1.output_logprobs + [0.0] * len(env) + o2.output_logprobs
    assert out.versions == o1.output_versions + [-1] * len(env) + o2.output_versions
    assert set(out.versions) - {-1} == {v0}
    # the env span is the template glue and the two tool turns (calculator result, unknown-tool error)
    assert tok.decode(env, skip_special_tokens=False) == (
        "\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>tool\nerror: unknown tool 'sleep'; available: calculator"
        "<|im_end|>\n<|im_start|>assistant\n<t1>")
    # "4", "2" as sampled, although the text re-encodes to the piece "42"
    four, two, piece = (tok.convert_tokens_to_ids(t) for t in ("4", "2", "42"))
    answer = o2.output_ids
    assert [four, two] == answer[-3:-1] and tok.encode(tok.decode(answer, skip_special_tokens=True))[-1] == piece
    assert [t.role for t in out.turns] == ["assistant", "tool", "assistant"]
    (trace,) = traces
    assert [c["finish_reason"] for c in trace["calls"]] == ["tool_calls", "stop"]
    assert trace["calls"][1]["content"] == "The answer is 42" and trace["reward"] == 1.0


def test_the_trajectory_round_trips_through_the_codec(srv):
    out, _ = run_agent(srv, "openai_example")
    traj = out.to_trajectory("g0")
    back = Trajectory.from_wire(decode(encode(traj.to_wire())))
    for name in ("prompt_ids", "response_ids", "loss_mask", "behav_logprobs", "versions"):
        np.testing.assert_array_equal(getattr(back, name), getattr(traj, name))
    assert back.reward == 1.0 and back.info["agent/calls"] == 2.0 and back.info["sample_id"] == "s0"


class UpdatesBetweenCalls(OpenAIAgentLoop):
    """Calls, lets the test act (a weight update), then answers the tool calls and calls again."""

    async def episode(self, client, sample):
        messages = list(sample.messages)
        first = (await client.chat.completions.create(model="any", messages=messages, tools=[CALCULATOR]))
        await self.between()
        messages.append(first.choices[0].message)  # the pydantic object itself, as many agents do
        for call in first.choices[0].message.tool_calls:
            messages.append({"role": "tool", "tool_call_id": call.id, "content": "42"})
        second = await client.chat.completions.create(model="any", messages=messages, tools=[CALCULATOR])
        return float(second.choices[0].message.content.endswith("42"))


def test_tokens_carry_the_version_that_sampled_them(srv):
    v0 = srv.engine.weight_version
    out, rec = run_agent(srv, UpdatesBetweenCalls, between=lambda: bump_version(srv, v0 + 1))
    (_, o1), (_, o2) = rec.seen
    assert out.metrics["chains"] == 1 and out.reward == 1.0
    assert o1.output_versions == [v0] * len(o1.output_ids) and o2.output_versions == [v0 + 1] * len(o2.output_ids)
    sampled = [v for v, m in zip(out.versions, out.response_mask) if m]
    assert sampled == o1.output_versions + o2.output_versions


class TwoQuestions(OpenAIAgentLoop):
    """Two unrelated conversations: the second does not extend the first."""

    async def episode(self, client, sample):
        for question in ("first?", "second?"):
            res = await client.chat.completions.create(model="any", messages=[{"role": "user", "content": question}],
                                                       max_tokens=5)
        return 0.5


def test_a_call_that_does_not_extend_the_chain_starts_a_new_one_and_only_the_last_is_trained(srv):
    out, rec = run_agent(srv, TwoQuestions)
    assert out.metrics["chains"] == 2 and out.metrics["dropped_calls"] == 1 and out.metrics["calls"] == 2
    (_, _), (p2, o2) = rec.seen
    assert out.prompt_ids == p2 and out.response_ids == o2.output_ids and len(o2.output_ids) == 5
    assert out.finish_reason == "length" and out.reward == 0.5


def test_the_response_budget_cuts_the_chain_and_further_calls_answer_length(srv):
    # turn 0 is 7 sampled tokens; the tool turns are cut at 10 tokens, so call 2 gets no generation
    out, rec = run_agent(srv, "openai_example", agent_cfg=AgentConfig(max_response_tokens=10))
    (_, o1), = rec.seen
    assert len(o1.output_ids) == 7 and out.response_mask == [1] * 7 + [0] * 3
    assert out.response_ids[:7] == o1.output_ids and len(out.behav_logprobs) == len(out.versions) == 10
    assert out.metrics["calls"] == 2 and out.finish_reason == "length" and out.reward == 0.0


class Misuse(OpenAIAgentLoop):
    """Asks for what the session refuses; returns what the test puts in `answer`."""

    answer: object = 1.0

    async def episode(self, client, sample):
        for kw, field in ((dict(stream=True), "stream"), (dict(n=2), "n"), (dict(max_tokens=0), "max_tokens")):
            with pytest.raises(openai.BadRequestError, match=field):
                await client.chat.completions.create(model="any", messages=sample.messages, **kw)
        with pytest.raises(openai.BadRequestError, match=r"messages\[0\].role"):
            await client.chat.completions.create(model="any", messages=[{"content": "no role"}])
        with pytest.raises(openai.NotFoundError, match="only POST /v1/chat/completions"):
            await client.models.list()
        await client.chat.completions.create(model="any", messages=sample.messages, max_tokens=2)
        return self.answer


def test_bad_requests_are_400_naming_the_field_and_a_bad_reward_is_a_clear_error(srv):
    out, _ = run_agent(srv, Misuse)
    assert out.reward == 1.0 and out.metrics["calls"] == 1
    bad = type("BadReward", (Misuse,), {"answer": "yes"})
    with pytest.raises(TypeError, match="BadReward.episode returned str, expected a float reward"):
        run_agent(srv, bad)


class Swallower(OpenAIAgentLoop):
    """Swallows every error of its calls, as careless agent code does."""

    async def episode(self, client, sample):
        try:
            await client.chat.completions.create(model="any", messages=sample.messages)
        except openai.APIError:
            pass
        return 0.0


def test_a_generation_failure_the_agent_swallows_still_fails_the_episode(srv):
    class Broken(Recording):
        async def generate(self, input_ids, sampling_params, request_id=None):
            raise RuntimeError("generation server gone")

    async def main():
        agent = Swallower(Broken(None), srv.tok, reward, AgentContext())
        return await agent.run(SAMPLE, PARAMS, group_id="g")
    with pytest.raises(RuntimeError, match="generation server gone"):
        asyncio.run(main())


def test_sampling_follows_the_run_not_the_request(srv):
    # the rollout's params (seeded) decide; a request's temperature is ignored, its max_tokens applies
    class Hot(OpenAIAgentLoop):
        async def episode(self, client, sample):
            await client.chat.completions.create(model="any", messages=sample.messages, temperature=0.0, max_tokens=3)
            return 0.0
    _, rec = run_agent(srv, Hot)
    used = rec.params[0]
    assert len(rec.seen[0][1].output_ids) == 3 and used.max_new_tokens == 3
    assert used.temperature == PARAMS.temperature and used.seed not in (None, PARAMS.seed)
    assert dataclasses.replace(used, max_new_tokens=PARAMS.max_new_tokens, seed=PARAMS.seed) == PARAMS
