"""Rollout invariant over a real server: a trained token's mask is 1 only if the model sampled it."""

import asyncio

import numpy as np
import pytest
import torch

from async_rl.agent import build_agent_loop
from async_rl.config import EngineConfig, ModelConfig, TaskConfig
from async_rl.engine.client import HttpGenerationClient
from async_rl.models import load_model, load_tokenizer
from async_rl.tasks import build_task
from async_rl.trainer.advantages import group_advantages
from async_rl.trainer.batching import collate
from async_rl.types import SamplingParams
from async_rl.launch.serve import BackgroundServer

MODEL = ModelConfig(dtype="float32", tiny_alphabet="01234+=", max_position=64)


@pytest.fixture(scope="module")
def server():
    torch.manual_seed(0)
    tok = load_tokenizer(MODEL)
    model = load_model(MODEL, seed=0, tokenizer=tok)
    srv = BackgroundServer.for_model(model, tok, EngineConfig(kv_cache_mb=4, block_size=8), model_name="tiny")
    url = srv.start()
    yield url, tok
    srv.stop()


def test_loss_mask_is_one_exactly_on_sampled_tokens(server):
    url, tok = server
    task = build_task(TaskConfig(max_operand=2, answer_pick="first"))

    async def go():
        client = HttpGenerationClient(url)
        try:
            agent = build_agent_loop("single_turn", client, tok, task.reward)
            samples = [s for s, _ in zip(task.train_samples(0), range(8))]
            params = SamplingParams(max_new_tokens=6, temperature=1.0)
            return samples, await asyncio.gather(*(agent.run(s, params, group_id=f"g{i % 2}")
                                                   for i, s in enumerate(samples)))
        finally:
            await client.close()

    samples, trajs = asyncio.run(go())
    for s, t in zip(samples, trajs):
        assert list(t.prompt_ids) == tok.encode(s.prompt, add_special_tokens=False)
        assert len(t.response_ids) >= 1 and t.loss_mask.dtype == np.uint8
        assert t.loss_mask.tolist() == [1] * len(t.response_ids)  # single turn: every response token sampled
        assert (t.versions == 0).all() and np.isfinite(t.behav_logprobs).all()
        assert t.reward == task.reward(s, tok.decode(t.response_ids.tolist(), skip_special_tokens=True))
    # in the trainer's layout, no prompt position is ever trained
    adv = group_advantages([t.reward for t in trajs], [t.group_id for t in trajs], std_norm=True)
    batch = collate(trajs, adv, list(range(len(trajs))))
    for b, t in enumerate(trajs):
        p = len(t.prompt_ids)
        assert batch.loss_mask[b, :p - 1].sum() == 0
        assert batch.loss_mask[b, p - 1:p - 1 + len(t.response_ids)].sum() == len(t.response_ids)
        assert batch.loss_mask[b].sum() == len(t.response_ids)
