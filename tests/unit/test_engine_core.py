"""The embedded engine against a fresh Hugging Face forward pass of the same weights.

Real tiny Llama models, real paged KV, real sampling: log-probs must match an unbatched
HF forward, greedy outputs must not depend on batching, preemption or a same-weights
interruption, and a weight change must show in versions and log-probs.
"""

import copy

import pytest
import torch

from async_rl.config import EngineConfig, ModelConfig
from async_rl.engine import model_runner
from async_rl.engine.llm_engine import EngineInputError, LLMEngine
from async_rl.models import PRINTABLE, build_tiny_tokenizer, load_model
from async_rl.types import SamplingParams

TEXTS = ["The quick brown fox", "jumps over", "the lazy dog and keeps running far away", "a",
         "Hello, world! Hello, world!", "0123456789", "lorem ipsum dolor sit amet, consectetur"]


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer(PRINTABLE)


@pytest.fixture(scope="module")
def model(tok):
    torch.manual_seed(0)
    return load_model(ModelConfig(dtype="float32", tiny_alphabet=PRINTABLE, max_position=256), seed=0, tokenizer=tok)


def make_engine(model, tok, **overrides):
    cfg = dict(kv_cache_mb=4, block_size=4, max_running=64, max_tokens_per_step=64)
    cfg.update(overrides)
    return LLMEngine(model, EngineConfig(**cfg), tokenizer=tok, eos_token_ids=[tok.eos_token_id])


def run(engine, requests, on_step=None):
    """requests: {rid: (prompt_ids, params)} -> {rid: GenerationOutput}."""
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    outs, steps = {}, 0
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = o.output
        steps += 1
        if on_step:
            on_step(engine, steps)
    return outs


def hf_logprobs(model, prompt, output, temperature):
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0].float()
    lp = torch.log_softmax(logits / (temperature or 1.0), dim=-1)
    return [lp[len(prompt) - 1 + j, t].item() for j, t in enumerate(output)]


def prompts(tok, n):
    base = [tok.encode(TEXTS[i % len(TEXTS)] + " #" * (i // len(TEXTS))) for i in range(n)]
    return [p[: 3 + (7 * i) % 29] for i, p in enumerate(base)]


def greedy_requests(tok, n, max_new=10):
    return {f"r{i}": (p, SamplingParams(max_new_tokens=max_new + i % 5, temperature=0.0, ignore_eos=True))
            for i, p in enumerate(prompts(tok, n))}


def test_logprobs_match_unbatched_hf_forward(model, tok):
    engine = make_engine(model, tok, max_tokens_per_step=24)  # small budget: chunked prefills mix with decodes
    shared = tok.encode("Shared system prompt: be brief. ")
    kinds = [dict(temperature=0.0), dict(temperature=1.0), dict(temperature=0.7, top_p=0.9),
             dict(temperature=1.3, top_k=5), dict(temperature=1.0, seed=3), dict(temperature=0.5)]
    reqs = {}
    for i, kw in enumerate(kinds):
        prompt = (shared if i % 2 else []) + tok.encode(TEXTS[i])
        reqs[f"r{i}"] = (prompt, SamplingParams(max_new_tokens=6 + 3 * i, ignore_eos=True, **kw))
    reqs["dup"] = (list(reqs["r1"][0]), SamplingParams(max_new_tokens=9, temperature=1.0))
    outs = run(engine, reqs)
    assert engine.stats()["engine/prefix_hit_rate"] > 0  # the shared prefix really was shared
    for rid, (prompt, params) in reqs.items():
        out = outs[rid]
        assert out.output_versions == [0] * len(out.output_ids)
        ref = hf_logprobs(model, prompt, out.output_ids, params.temperature)
        assert max(abs(a - b) for a, b in zip(ref, out.output_logprobs)) <= 1e-4, rid


def _interrupt_same_weights(engine, steps):
    if steps in (3, 7):
        engine.update_weights(engine.model.state_dict(), version=0)


@pytest.mark.parametrize("mode", ["batched", "preempted", "interrupted"])
def test_greedy_output_independent_of_batching(model, tok, mode):
    reqs = greedy_requests(tok, 32)
    alone = {}
    for rid, req in reqs.items():
        alone.update(run(make_engine(model, tok), {rid: req}))
    engine = make_engine(model, tok, kv_cache_mb=0.03 if mode == "preempted" else 4)
    together = run(engine, reqs, _interrupt_same_weights if mode == "interrupted" else None)
    for rid in reqs:
        assert together[rid].output_ids == alone[rid].output_ids, rid
        assert together[rid].finish_reason == "length"
    if mode == "preempted":
        assert engine.stats()["engine/preemptions"] > 0
        assert engine.stats()["engine/recomputed_tokens"] > 0
    if mode == "interrupted":
        assert all(o.num_interruptions >= 1 for o in together.values())
    else:
        assert all(o.num_interruptions == 0 for o in together.values())


def update_mid_generation(model, tok, keep_kv):
    """5 sampled requests; after 4 steps perturbed weights load as version 1. Returns the old and new
    models, the requests, their outputs and the update's stats; checks the versions split once."""
    old = copy.deepcopy(model)
    new = copy.deepcopy(model)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    engine = make_engine(copy.deepcopy(model), tok)
    reqs = {f"r{i}": (p, SamplingParams(max_new_tokens=12, temperature=1.0, ignore_eos=True))
            for i, p in enumerate(prompts(tok, 5))}
    stats = {}

    def update(eng, steps):
        if steps == 4:
            stats.update(eng.update_weights(new.state_dict(), version=1, keep_kv=keep_kv))

    outs = run(engine, reqs, update)
    for out in outs.values():
        assert out.num_interruptions == 1
        cut = out.output_versions.index(1)
        assert 0 < cut and set(out.output_versions[cut:]) == {1} and set(out.output_versions[:cut]) == {0}
    return old, new, reqs, outs, {**stats, **engine.stats()}


def test_weight_change_mid_generation_tags_versions(model, tok):
    old, new, reqs, outs, stats = update_mid_generation(model, tok, keep_kv=False)
    assert stats["engine/interrupted"] == 5 and stats["engine/recomputed_tokens"] > 0
    for rid, (prompt, _) in reqs.items():
        out = outs[rid]
        cut = out.output_versions.index(1)
        ref_old = hf_logprobs(old, prompt, out.output_ids, 1.0)[:cut]
        ref_new = hf_logprobs(new, prompt, out.output_ids, 1.0)[cut:]
        assert max(abs(a - b) for a, b in zip(ref_old + ref_new, out.output_logprobs)) <= 1e-4, rid


def test_weight_change_keeping_kv_goes_on_over_the_old_weights_kv(model, tok):
    """keep_kv (SGLang's update under an in_place pause): nothing is recomputed, and the first token
    after the update attends to keys and values the old weights computed. Its log-probs equal HF's
    with the old model's cache continued by the new model, and not a fresh forward of the new one."""
    old, new, reqs, outs, stats = update_mid_generation(model, tok, keep_kv=True)
    assert stats["engine/interrupted"] == 0 and stats["engine/kv_kept"] == 5
    assert stats["engine/recomputed_tokens"] == 0
    fresh_gap = 0.0
    for rid, (prompt, _) in reqs.items():
        out = outs[rid]
        cut = out.output_versions.index(1)
        ids = torch.tensor([prompt + out.output_ids])
        held = len(prompt) + cut - 1  # tokens whose KV the old weights computed before the update
        with torch.no_grad():
            cache = old(ids[:, :held], use_cache=True).past_key_values
            logits = new(ids[:, held:], cache=cache).logits[0].float()
        lp = torch.log_softmax(logits, dim=-1)
        ref_mixed = [lp[j - cut, t].item() for j, t in enumerate(out.output_ids) if j >= cut]
        ref_old = hf_logprobs(old, prompt, out.output_ids, 1.0)[:cut]
        assert max(abs(a - b) for a, b in zip(ref_old + ref_mixed, out.output_logprobs)) <= 1e-4, rid
        fresh = hf_logprobs(new, prompt, out.output_ids, 1.0)[cut:]
        fresh_gap = max(fresh_gap, max(abs(a - b) for a, b in zip(fresh, ref_mixed)))
    assert fresh_gap > 1e-3, "the check could not tell kept KV from recomputed KV"


def test_update_weights_rejects_bad_state_dict(model, tok):
    engine = make_engine(model, tok)
    sd = model.state_dict()
    with pytest.raises(ValueError, match="unknown"):
        engine.update_weights({**sd, "model.bogus.weight": torch.zeros(1)}, 1)
    with pytest.raises(ValueError, match="missing"):
        engine.update_weights({k: v for k, v in sd.items() if "layers.1.mlp" not in k}, 1)
    with pytest.raises(ValueError, match="shape"):
        engine.update_weights({**sd, "model.norm.weight": torch.zeros(3)}, 1)
    assert engine.policy_version == 0


def test_tiny_kv_budget_completes_by_preemption(model, tok):
    engine = make_engine(model, tok, kv_cache_mb=0.012)  # 6 blocks of 4 tokens
    reqs = {f"r{i}": (p[:8], SamplingParams(max_new_tokens=12, temperature=1.0, ignore_eos=True, seed=i))
            for i, p in enumerate(prompts(tok, 12))}
    outs = run(engine, reqs)
    assert all(len(outs[r].output_ids) == 12 for r in reqs)
    assert engine.stats()["engine/preemptions"] > 0
    assert engine.stats()["engine/kv_blocks_used"] == 0
    with pytest.raises(EngineInputError, match="KV blocks"):
        engine.add_request("huge", prompts(tok, 1)[0], SamplingParams(max_new_tokens=40))


def test_prefix_sharing_group_and_multi_turn(model, tok):
    prompt = tok.encode("You are a helpful assistant. Solve: 12+30=")
    params = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    group = {f"g{i}": (prompt, params) for i in range(8)}
    cached = make_engine(model, tok)
    outs = run(cached, group)
    plain = run(make_engine(model, tok, enable_prefix_caching=False), group)
    assert sum(o.prefix_cached_tokens > 0 for o in outs.values()) >= 7
    assert all(outs[r].output_ids == plain[r].output_ids for r in group)
    assert all(o.prefix_cached_tokens == 0 for o in plain.values())
    turn2 = prompt + outs["g0"].output_ids + tok.encode(" And 1+1=")
    out2 = run(cached, {"t2": (turn2, params)})["t2"]
    assert out2.prefix_cached_tokens >= len(prompt) + len(outs["g0"].output_ids) - 4 - 1
    ref = hf_logprobs(model, turn2, out2.output_ids, 0.0)
    assert max(abs(a - b) for a, b in zip(ref, out2.output_logprobs)) <= 1e-4


@pytest.mark.parametrize("prompt, params, field", [
    ([5, 99999], SamplingParams(), r"input_ids\[1\]: token id 99999 outside the vocabulary"),
    ([], SamplingParams(), "input_ids"),
    ([5] * 250, SamplingParams(max_new_tokens=10), "max_position_embeddings"),
    ([5] * 300, SamplingParams(max_new_tokens=1), "input_ids"),
    ([5], SamplingParams(top_p=0.0), "sampling_params.top_p"),
    ([5], SamplingParams(temperature=-1.0), "sampling_params.temperature"),
    ([5], SamplingParams(max_new_tokens=0), "sampling_params.max_new_tokens"),
])
def test_add_request_validation(model, tok, prompt, params, field):
    engine = make_engine(model, tok)
    with pytest.raises(EngineInputError, match=field):
        engine.add_request("x", prompt, params)
    assert not engine.has_unfinished()


def test_duplicate_request_id_and_abort(model, tok):
    engine = make_engine(model, tok)
    engine.add_request("a", [5, 6, 7], SamplingParams(max_new_tokens=50, ignore_eos=True))
    with pytest.raises(EngineInputError, match="rid"):
        engine.add_request("a", [5], SamplingParams())
    engine.step()
    engine.step()
    assert engine.abort_request("a") and not engine.abort_request("a")
    [out] = engine.step()
    assert out.finished and out.output.finish_reason == "abort" and len(out.output.output_ids) == 2
    assert not engine.has_unfinished() and engine.stats()["engine/kv_blocks_used"] == 0


def test_stop_tokens_strings_and_eos(model, tok):
    prompt = tok.encode(TEXTS[2])
    base = run(make_engine(model, tok), {"g": (prompt, SamplingParams(max_new_tokens=12, temperature=0.0))})["g"]
    ids = base.output_ids
    stop_tok = ids[3]
    first = ids.index(stop_tok)
    cases = {
        "tok": SamplingParams(max_new_tokens=12, temperature=0.0, stop_token_ids=(stop_tok,)),
        "str": SamplingParams(max_new_tokens=12, temperature=0.0, stop=(tok.decode(ids[4:6]),)),
    }
    outs = run(make_engine(model, tok), {k: (prompt, p) for k, p in cases.items()})
    assert outs["tok"].output_ids == ids[:first + 1] and outs["tok"].finish_reason == "stop"
    assert outs["str"].finish_reason == "stop" and tok.decode(ids[4:6]) in tok.decode(outs["str"].output_ids)
    assert len(outs["str"].output_ids) <= 6
    eos_engine = LLMEngine(model, EngineConfig(kv_cache_mb=1, block_size=4), eos_token_ids=[stop_tok])
    eos_outs = run(eos_engine, {"eos": (prompt, SamplingParams(max_new_tokens=12, temperature=0.0)),
                                "ign": (prompt, SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True))})
    assert eos_outs["eos"].output_ids == ids[:first + 1] and eos_outs["eos"].finish_reason == "stop"
    assert eos_outs["ign"].output_ids == ids and eos_outs["ign"].finish_reason == "length"
    with pytest.raises(EngineInputError, match="sampling_params.stop"):
        eos_engine.add_request("s", prompt, SamplingParams(stop=("x",)))


def test_seeded_sampling_is_batch_independent_and_top_logprobs(model, tok):
    params = SamplingParams(max_new_tokens=10, temperature=1.0, seed=1234, top_logprobs=3, ignore_eos=True)
    prompt = tok.encode(TEXTS[0])
    alone = run(make_engine(model, tok), {"s": (prompt, params)})["s"]
    others = {f"o{i}": (p, SamplingParams(max_new_tokens=4 + i, temperature=1.0, seed=i if i % 2 else None))
              for i, p in enumerate(prompts(tok, 15))}
    crowd = run(make_engine(model, tok), {"s": (prompt, params), **others})["s"]
    assert crowd.output_ids == alone.output_ids
    assert max(abs(a - b) for a, b in zip(crowd.output_logprobs, alone.output_logprobs)) <= 1e-5
    with torch.no_grad():
        logits = model(torch.tensor([prompt + crowd.output_ids])).logits[0].float()
    for j, top in enumerate(crowd.output_top_logprobs):
        ref_vals, ref_ids = torch.log_softmax(logits[len(prompt) - 1 + j], -1).topk(3)
        assert [t for t, _ in top] == ref_ids.tolist()
        assert max(abs(lp - r) for (_, lp), r in zip(top, ref_vals.tolist())) <= 1e-4
    greedy = run(make_engine(model, tok), {"g": (prompt, SamplingParams(max_new_tokens=10, temperature=0.0))})
    top1 = run(make_engine(model, tok), {"k": (prompt, SamplingParams(max_new_tokens=10, top_k=1)),
                                         "p": (prompt, SamplingParams(max_new_tokens=10, top_p=1e-6))})
    assert top1["k"].output_ids == top1["p"].output_ids == greedy["g"].output_ids


@pytest.mark.parametrize("kw, expect", [
    (dict(temperature=1.0), [0.5, 0.3, 0.15, 0.05]),
    (dict(temperature=0.5), [0.5**2, 0.3**2, 0.15**2, 0.05**2]),
    (dict(temperature=1.0, top_k=2), [0.5, 0.3, 0.0, 0.0]),
    (dict(temperature=1.0, top_p=0.85), [0.5, 0.3, 0.15, 0.0]),
])
def test_sampler_draws_from_the_truncated_distribution(kw, expect):
    from async_rl.engine.sampler import Sampler
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    n = 20000
    params = [SamplingParams(**kw)] * n
    result = Sampler(torch.device("cpu"), seed=0)(probs.log().repeat(n, 1), params, [None] * n)
    freq = torch.bincount(torch.tensor(result.token_ids), minlength=4).float() / n
    expect = torch.tensor(expect) / sum(expect)
    assert torch.allclose(freq, expect, atol=0.015), (freq, expect)
    full = torch.log_softmax(probs.log() / kw["temperature"], -1)  # reported: the untruncated distribution
    assert torch.allclose(torch.tensor(result.logprobs), full[torch.tensor(result.token_ids)], atol=1e-6)


def test_qwen2_biases_and_rope_theta_are_used(tok):
    from transformers import Qwen2Config, Qwen2ForCausalLM
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      rope_parameters={"rope_type": "default", "rope_theta": 500.0}, tie_word_embeddings=False)
    torch.manual_seed(1)
    qwen = Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():  # biases start at zero: make them matter
        for layer in qwen.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0.0, 0.5)
    engine = LLMEngine(qwen, EngineConfig(kv_cache_mb=1, block_size=4, max_tokens_per_step=16))
    reqs = {f"q{i}": (p, SamplingParams(max_new_tokens=8, temperature=1.0, ignore_eos=True))
            for i, p in enumerate(prompts(tok, 4))}
    outs = run(engine, reqs)
    for rid, (prompt, _) in reqs.items():
        ref = hf_logprobs(qwen, prompt, outs[rid].output_ids, 1.0)
        assert max(abs(a - b) for a, b in zip(ref, outs[rid].output_logprobs)) <= 1e-4, rid


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 0.1)])
def test_fused_projections_follow_parameters_replaced_or_biased_unevenly(model, tok, dtype, tol, monkeypatch):
    """q/k/v and gate/up run as one GEMM over weights the modules' parameters are views of (on a CPU also
    pre-packed for oneDNN; in fp32 only weights of 1 MB and more, so here the tiny model's are packed by
    lowering that floor): weights loaded in place are what the next step computes with, a state dict
    loaded with assign=True (new memory) is laid out again, and a layer whose projections have a bias on
    some only runs them one by one; each time the log-probs are a fresh HF forward's."""
    monkeypatch.setattr(model_runner, "PACKED_MIN_WEIGHT", 0)
    mine = copy.deepcopy(model).to(dtype)
    engine = make_engine(mine, tok)
    reqs = lambda tag: {f"{tag}{i}": (p, SamplingParams(max_new_tokens=6, temperature=1.0, ignore_eos=True))
                        for i, p in enumerate(prompts(tok, 4))}

    def check(tag):
        outs = run(engine, reqs(tag))
        for rid, (prompt, _) in reqs(tag).items():
            ref = hf_logprobs(mine, prompt, outs[rid].output_ids, 1.0)
            assert max(abs(a - b) for a, b in zip(ref, outs[rid].output_logprobs)) <= tol, rid

    check("a")
    layer = mine.model.layers[0]
    assert layer.self_attn.k_proj.weight.data_ptr() == \
        layer.self_attn.q_proj.weight.data_ptr() + layer.self_attn.q_proj.weight.nbytes  # laid back to back
    engine.update_weights({k: v + 0.1 * torch.randn_like(v) for k, v in mine.state_dict().items()}, version=1)
    check("in place")
    moved = {k: v + 0.1 * torch.randn_like(v) for k, v in mine.state_dict().items()}
    mine.load_state_dict(moved, assign=True)  # every parameter in new memory
    engine.commit_weights(2)
    check("b")
    with torch.no_grad():
        layer.self_attn.k_proj.bias = torch.nn.Parameter(torch.randn(layer.self_attn.k_proj.weight.shape[0], dtype=dtype))
        layer.mlp.up_proj.bias = torch.nn.Parameter(torch.randn(layer.mlp.up_proj.weight.shape[0], dtype=dtype))
    engine.commit_weights(3)
    check("c")


def test_unsupported_architectures_are_rejected(tok):
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM
    from async_rl.engine.model_runner import UnsupportedModelError
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=99, n_embd=32, n_layer=1, n_head=2, n_positions=64))
    with pytest.raises(UnsupportedModelError, match="not supported"):
        LLMEngine(gpt2, EngineConfig(kv_cache_mb=1))
    dynamic = LlamaForCausalLM(LlamaConfig(vocab_size=99, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                           num_attention_heads=2, rope_parameters={"rope_type": "dynamic",
                                                                                   "rope_theta": 1e4, "factor": 2.0}))
    with pytest.raises(UnsupportedModelError, match="rope_type"):
        LLMEngine(dynamic, EngineConfig(kv_cache_mb=1))


def test_bfloat16_model_computes_in_bfloat16_close_to_hf(model, tok):
    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    engine = make_engine(bf16, tok)
    assert engine.runner.kv.dtype == torch.bfloat16
    reqs = {f"b{i}": (p, SamplingParams(max_new_tokens=8, temperature=1.0, ignore_eos=True, seed=i))
            for i, p in enumerate(prompts(tok, 6))}
    outs = run(engine, reqs)
    for rid, (prompt, _) in reqs.items():
        ref = hf_logprobs(bf16, prompt, outs[rid].output_ids, 1.0)
        assert max(abs(a - b) for a, b in zip(ref, outs[rid].output_logprobs)) <= 0.05, rid


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_engine_on_gpu_matches_hf(model, tok):
    gpu = copy.deepcopy(model).cuda()
    engine = make_engine(gpu, tok)
    reqs = {f"c{i}": (p, SamplingParams(max_new_tokens=8, temperature=1.0, ignore_eos=True, seed=i))
            for i, p in enumerate(prompts(tok, 6))}
    outs = run(engine, reqs)
    for rid, (prompt, _) in reqs.items():
        ref = hf_logprobs(model, prompt, outs[rid].output_ids, 1.0)
        assert max(abs(a - b) for a, b in zip(ref, outs[rid].output_logprobs)) <= 1e-3, rid


def test_step_profile_counts_every_step_by_threads_and_batch(model, tok):
    """The simulator's calibration reads these sums: steps, seconds, sequences sampled, their context
    and prompt tokens, by (torch threads, sequences sampled rounded down to a power of 2)."""
    engine = make_engine(model, tok)
    params = SamplingParams(max_new_tokens=5, temperature=1.0, ignore_eos=True)
    run(engine, {f"r{i}": (tok.encode("abcd"), params) for i in range(3)})
    prompt = len(tok.encode("abcd"))
    stats = {k.removeprefix("engine/step_"): v for k, v in engine.stats().items() if k.startswith("engine/step_t")}
    threads = torch.get_num_threads()
    assert set(stats) == {f"t{threads}_b2_{f}" for f in ("n", "s", "seqs", "ctx", "prefill")}
    assert stats[f"t{threads}_b2_n"] == 5 and stats[f"t{threads}_b2_seqs"] == 15
    assert stats[f"t{threads}_b2_prefill"] == 3 * prompt
    assert stats[f"t{threads}_b2_ctx"] == 3 * sum(prompt + k for k in range(5))
    assert stats[f"t{threads}_b2_s"] > 0


def test_the_kv_pool_holds_at_most_four_times_what_max_running_full_contexts_need(model, tok):
    """A GPU share sized for real models gave the debug model 26M blocks (2 s to start, 1 GB of host
    lists, benchmarks/results/gpu_check.md): the pool stops at what it can ever use, and still generates."""
    from async_rl.engine.llm_engine import KV_POOL_HEADROOM

    engine = make_engine(model, tok, kv_cache_mb=4096, max_running=8)  # ~2.6M blocks budgeted
    most = KV_POOL_HEADROOM * 8 * (256 // 4)
    assert engine.block_manager.num_blocks == most and engine.runner.kv.shape[2] == most
    small = make_engine(model, tok, kv_cache_mb=2, max_running=8)  # under the cap: as budgeted
    assert small.block_manager.num_blocks < most
    out = run(engine, {"a": (tok.encode("Hello"), SamplingParams(max_new_tokens=8, temperature=1.0, ignore_eos=True))})
    assert len(out["a"].output_ids) == 8
