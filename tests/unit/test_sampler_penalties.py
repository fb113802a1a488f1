"""SGLang's extra sampling params: the draw follows the penalised distribution, the reported log-prob
stays the policy's; and `SamplingParams.from_wire` takes SGLang's map (null = unset, constraints refused)."""

from types import SimpleNamespace

import pytest
import torch

from async_rl.engine.sampler import Sampler
from async_rl.types import SamplingParams

PROBS = torch.tensor([0.5, 0.3, 0.15, 0.05])
N = 20000


def draw(params: SamplingParams, output_ids: list[int], stop_ids=frozenset()) -> tuple[torch.Tensor, torch.Tensor]:
    state = SimpleNamespace(output_ids=output_ids, stop_ids=frozenset(stop_ids))
    result = Sampler(torch.device("cpu"), seed=0)(PROBS.log().repeat(N, 1), [params] * N, [None] * N, [state] * N)
    tokens = torch.tensor(result.token_ids)
    full = torch.log_softmax(PROBS.log() / params.temperature, -1)  # reported: the unpenalised policy
    assert torch.allclose(torch.tensor(result.logprobs), full[tokens], atol=1e-6)
    return torch.bincount(tokens, minlength=4).float() / N, full


@pytest.mark.parametrize("kw, output_ids, expect", [
    (dict(presence_penalty=1.0), [0, 0, 1], PROBS * torch.exp(-torch.tensor([1.0, 1.0, 0.0, 0.0]))),
    (dict(frequency_penalty=0.5), [0, 0, 1], PROBS * torch.exp(-0.5 * torch.tensor([2.0, 1.0, 0.0, 0.0]))),
    (dict(min_p=0.5), [], torch.tensor([0.5, 0.3, 0.0, 0.0])),
    (dict(logit_bias={3: float(torch.log(torch.tensor(10.0)))}), [], PROBS * torch.tensor([1.0, 1.0, 1.0, 10.0])),
])
def test_the_draw_follows_the_penalised_distribution(kw, output_ids, expect):
    freq, _ = draw(SamplingParams(**kw), output_ids)
    assert torch.allclose(freq, expect / expect.sum(), atol=0.015), (freq, expect / expect.sum())


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits():
    logits = torch.tensor([[2.0, -1.0, 0.5, 0.0]])
    params = SamplingParams(repetition_penalty=2.0, temperature=0.0)
    state = SimpleNamespace(output_ids=[0, 1], stop_ids=frozenset())
    adjusted = Sampler._adjust(logits[0].clone(), params, state)
    assert adjusted.tolist() == [1.0, -2.0, 0.5, 0.0]
    result = Sampler(torch.device("cpu"), seed=0)(logits, [params], [None], [state])
    assert result.token_ids == [0] and abs(result.logprobs[0] - torch.log_softmax(logits[0], -1)[0].item()) < 1e-6


def test_min_new_tokens_keeps_stop_tokens_out_of_the_draw():
    freq, _ = draw(SamplingParams(min_new_tokens=3), [1], stop_ids={0})
    assert freq[0] == 0.0
    freq, _ = draw(SamplingParams(min_new_tokens=1), [1], stop_ids={0})  # one token out: stops allowed again
    assert abs(freq[0] - 0.5) < 0.015


def test_from_wire_takes_sglangs_map():
    params = SamplingParams.from_wire({"max_new_tokens": 5, "temperature": None, "top_k": None, "n": None,
                                       "stop": [], "stop_regex": [], "regex": None, "json_schema": None,
                                       "sampling_seed": 9, "spaces_between_special_tokens": True,
                                       "logit_bias": {"3": 1.5}})
    assert params == SamplingParams(max_new_tokens=5, seed=9, logit_bias={3: 1.5})
    assert SamplingParams.from_wire(params.to_wire()) == params
    assert params.to_wire() == {"max_new_tokens": 5, "temperature": 1.0, "logit_bias": {"3": 1.5}, "sampling_seed": 9}
    for bad, key in [({"regex": "a"}, "sampling_params.regex"), ({"json_schema": "{}"}, "sampling_params.json_schema"),
                     ({"beam_width": 2}, "sampling_params.beam_width"), ({"min_p": 2}, "sampling_params.min_p"),
                     ({"repetition_penalty": 0}, "sampling_params.repetition_penalty"),
                     ({"n": 0}, "sampling_params.n"), ({"bogus": 1}, "sampling_params.bogus")]:
        with pytest.raises(ValueError, match=key.replace(".", r"\.")):
            SamplingParams.from_wire(bad)
