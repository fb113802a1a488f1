"""A version that arrives in parts (one `dist` bucket per request) goes straight into the parameters,
and no forward pass mixes two versions: the loop is held from the first part until the version
is complete, then the requests in flight continue under it."""

import asyncio
import copy

import pytest
import torch

from async_rl.config import EngineConfig, ModelConfig
from async_rl.engine.async_engine import AsyncEngine
from async_rl.engine.llm_engine import LLMEngine
from async_rl.models import build_tiny_tokenizer, load_model
from async_rl.types import SamplingParams
from async_rl.weight_sync.staging import WeightVersionError

ALPHABET = "0123456789+= "


def test_a_version_in_parts_holds_the_loop_until_it_is_complete():
    torch.set_num_threads(1)
    tok = build_tiny_tokenizer(ALPHABET)
    model = load_model(ModelConfig(dtype="float32", tiny_alphabet=ALPHABET), seed=0, tokenizer=tok)
    new = {k: v + 0.01 for k, v in copy.deepcopy(model).state_dict().items() if k != "lm_head.weight"}
    names = list(new)
    first, second = [(n, new[n]) for n in names[:3]], [(n, new[n]) for n in names[3:]]
    engine = AsyncEngine(LLMEngine(model, EngineConfig(kv_cache_mb=4, block_size=8), tokenizer=tok,
                                   eos_token_ids=[tok.eos_token_id])).start()

    async def drive():
        params = SamplingParams(max_new_tokens=400, temperature=1.0, ignore_eos=True)
        gen = asyncio.ensure_future(engine.generate("r", [3, 4, 5], params))
        while engine.stats()["engine/steps_total"] < 3:
            await asyncio.sleep(0.005)
        part = await engine.load_tensors(first, None)
        assert part["engine/weights_complete"] == 0.0
        assert engine.paused and engine.weight_version == 0  # held: nothing steps on half-new weights
        steps = engine.stats()["engine/steps_total"]
        await asyncio.sleep(0.2)
        assert engine.stats()["engine/steps_total"] == steps
        done = await engine.load_tensors(second, 1)
        assert done["engine/weights_complete"] == 1.0 and engine.weight_version == 1 and not engine.paused
        with pytest.raises(WeightVersionError, match="not newer"):
            await engine.load_tensors([(names[0], torch.zeros_like(new[names[0]]))], 1)
        return await gen

    try:
        out = asyncio.run(drive())
    finally:
        engine.shutdown()
    assert set(out.output_versions) == {0, 1}  # it continued under the new weights
    assert out.output_versions == sorted(out.output_versions)
    served = model.state_dict()
    assert all(torch.equal(served[n], new[n]) for n in names)  # the refused part copied nothing
