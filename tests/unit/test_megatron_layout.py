"""HF Llama <-> Megatron-core layout (async_rl/trainer/backends/megatron_layout.py).

Pure tensor round trips across TP sizes (bit-exact, every HF tensor) and the refusals.
Shapes: tied with 9 heads / 3 KV heads, untied with 8 / 2 and head_dim 12 != hidden / heads.
Through a real GPTModel (the HF log-probs, and a wrong layout that must not give them):
tests/integration/test_megatron_trainer.py, whose processes already hold a megatron group.
"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from async_rl.trainer.backends.megatron_layout import LlamaShape, hf_specs, params, to_hf, to_shard

SHAPES = {"tied-9-3": dict(num_attention_heads=9, num_key_value_heads=3, head_dim=8, tie_word_embeddings=True),
          "untied-8-2": dict(num_attention_heads=8, num_key_value_heads=2, head_dim=12, tie_word_embeddings=False)}


def _hf(case: str) -> LlamaForCausalLM:
    cfg = LlamaConfig(vocab_size=36, hidden_size=72, intermediate_size=48, num_hidden_layers=2,
                      max_position_embeddings=64, rms_norm_eps=1e-5, **SHAPES[case])
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).eval()


def _round_trip(sd: dict[str, torch.Tensor], shape: LlamaShape, tp: int) -> dict[str, torch.Tensor]:
    back = {}
    for p in params(shape):
        shards = [to_shard(p, sd.__getitem__, r, tp, shape) for r in range(tp)]
        back.update(to_hf(p, shards, shape))
    return back


@pytest.mark.parametrize("case,tp", [("tied-9-3", 1), ("tied-9-3", 3), ("untied-8-2", 1), ("untied-8-2", 2)])
def test_tp_shards_round_trip_bit_exact(case, tp):
    hf = _hf(case)
    shape = LlamaShape.from_hf(hf.config)
    shape.check_tp(tp)
    sd = hf.state_dict()
    back = _round_trip(sd, shape, tp)
    assert [n for n, _ in hf_specs(shape)] == list(back)  # HF order, the tied head not repeated
    assert set(sd) - set(back) == ({"lm_head.weight"} if shape.tied else set())
    for name, t in back.items():
        assert torch.equal(t, sd[name]), name
        assert dict(hf_specs(shape))[name] == tuple(t.shape)


def test_sizes_tp_does_not_divide_are_one_clear_error():
    for case, tp, what in (("tied-9-3", 2, "attention heads \\(9\\)"), ("untied-8-2", 4, "key/value heads \\(2\\)"),
                           ("untied-8-2", 8, "key/value heads")):
        with pytest.raises(ValueError, match=rf"^trainer.tensor_parallel: {tp} does not divide the model's {what}"):
            LlamaShape.from_hf(_hf(case).config).check_tp(tp)
    config = _hf("untied-8-2").config
    config.vocab_size = 35
    with pytest.raises(ValueError, match=r"^trainer.tensor_parallel: 2 does not divide the model's vocabulary size \(35\)"):
        LlamaShape.from_hf(config).check_tp(2)


def test_a_model_it_cannot_map_is_one_clear_error():
    cfg = LlamaConfig(vocab_size=16, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, attention_bias=True)
    with pytest.raises(ValueError, match=r"^model.name: .*without biases, this one has attention_bias=True"):
        LlamaShape.from_hf(cfg)
    cfg.model_type = "qwen2"
    with pytest.raises(ValueError, match=r"^model.name: trainer.backend=megatron maps llama models only"):
        LlamaShape.from_hf(cfg)
