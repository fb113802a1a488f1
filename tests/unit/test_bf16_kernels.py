"""The compiled bf16 kernels (async_rl/engine/bf16_kernels.py) against torch's ops on the same bf16 inputs, and a
bf16 engine running them whose log-probs match a fresh Hugging Face forward as closely as torch's path does."""

import copy

import pytest
import torch
import torch.nn.functional as F

from async_rl.config import EngineConfig, ModelConfig
from async_rl.engine import bf16_kernels, cpu_kernels
from async_rl.engine.llm_engine import LLMEngine
from async_rl.models import PRINTABLE, build_tiny_tokenizer, load_model
from async_rl.types import SamplingParams

ok, why = bf16_kernels.available()
needs_kernels = pytest.mark.skipif(not ok, reason=f"bf16 kernels unavailable: {why}")
BF16_ULP = 2 ** -7  # relative spacing of bf16 numbers: one rounding apart


def close(got: torch.Tensor, want: torch.Tensor, ulps: float = 2) -> bool:
    """Within `ulps` bf16 roundings of each other (relative to the larger magnitude, or absolute near 0)."""
    scale = torch.maximum(got.float().abs(), want.float().abs()).clamp(min=1e-2)
    return bool(((got.float() - want.float()).abs() <= ulps * BF16_ULP * scale).all())


def bf16(*shape, gen, scale=1.0):
    return (scale * torch.randn(*shape, generator=gen)).to(torch.bfloat16)


@needs_kernels
@pytest.mark.parametrize("m,h", [(1, 16), (5, 576), (33, 100), (7, 8)])
def test_add_rms_norm_adds_in_place_as_torch_rounds_and_normalises(m, h):
    gen = torch.Generator().manual_seed(m * h)
    x, delta, w = bf16(m, h + 3, gen=gen)[:, :h], bf16(m, h, gen=gen), bf16(h, gen=gen)  # x: rows of a wider tensor
    want_x = x + delta  # bf16 add: fp32 sum rounded to nearest even
    xf = want_x.float()
    want = w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(torch.bfloat16)
    got = bf16_kernels.add_rms_norm(x, delta, w, 1e-5)
    assert torch.equal(x, want_x)  # the residual, bit for bit
    assert close(got, want)
    alone = bf16_kernels.add_rms_norm(want_x.clone(), None, w, 1e-5)  # no delta: x untouched, only the norm
    assert torch.equal(alone, got)


@needs_kernels
@pytest.mark.parametrize("heads,d", [(12, 64), (3, 16), (2, 40)])
def test_rotary_in_place_matches_the_engines_torch_rotation(heads, d):
    gen = torch.Generator().manual_seed(heads * d)
    n, table = 9, 50
    x = bf16(n, heads * d + 5 * d, gen=gen)  # q and k heads first, then v's (left alone)
    cos, sin = bf16(table, d, gen=gen), bf16(table, d, gen=gen)
    pos = torch.randint(0, table, (n,), generator=gen)
    ref = x[:, :heads * d].float().view(n, heads, d)
    c, s = cos.float()[pos][:, None], sin.float()[pos][:, None]
    want = ref * c + ref.roll(d // 2, dims=-1) * s
    rest = x[:, heads * d:].clone()
    bf16_kernels.rotary(x, heads, d, cos, sin, pos)  # without pools: the rotation alone
    assert close(x[:, :heads * d].view(n, heads, d), want.to(torch.bfloat16), ulps=1)
    assert torch.equal(x[:, heads * d:], rest)


@needs_kernels
def test_rotary_writes_the_rotated_keys_and_the_values_into_the_pool_at_the_slots():
    gen = torch.Generator().manual_seed(3)
    n, heads, kvh, d, slots_total = 6, 6, 2, 64, 40
    x = bf16(n, (heads + 2 * kvh) * d, gen=gen)  # q, k, v side by side, as the fused GEMM lays them
    cos, sin = bf16(20, d, gen=gen), bf16(20, d, gen=gen)
    pos, slots = torch.randint(0, 20, (n,), generator=gen), torch.randperm(slots_total, generator=gen)[:n]
    k_pool, v_pool = torch.zeros(slots_total, kvh, d, dtype=torch.bfloat16), torch.zeros(slots_total, kvh, d,
                                                                                          dtype=torch.bfloat16)
    alone = x.clone()
    bf16_kernels.rotary(alone, heads + kvh, d, cos, sin, pos)
    bf16_kernels.rotary(x, heads + kvh, d, cos, sin, pos, kvh, slots, k_pool, v_pool)
    assert torch.equal(x, alone)
    assert torch.equal(k_pool[slots], x[:, heads * d:(heads + kvh) * d].view(n, kvh, d))
    assert torch.equal(v_pool[slots], x[:, (heads + kvh) * d:].view(n, kvh, d))
    untouched = torch.ones(slots_total, dtype=torch.bool)
    untouched[slots] = False
    assert not k_pool[untouched].any() and not v_pool[untouched].any()


@needs_kernels
@pytest.mark.parametrize("m,i", [(4, 1536), (3, 40), (1, 7)])
def test_silu_mul_matches_torch(m, i):
    gen = torch.Generator().manual_seed(m + i)
    gate_up = bf16(m, 2 * i, gen=gen, scale=4.0)
    want = F.silu(gate_up[:, :i].float()) * gate_up[:, i:].float()
    assert close(bf16_kernels.silu_mul(gate_up), want.to(torch.bfloat16), ulps=1)


@needs_kernels
@pytest.mark.parametrize("b,kvh,g,d,w", [(5, 3, 3, 64, 64), (4, 2, 4, 128, 256), (3, 1, 7, 16, 96), (1, 1, 1, 16, 32)])
def test_slab_attention_writes_the_new_kv_and_attends_over_each_rows_own_keys(b, kvh, g, d, w):
    """Past a row's length the tier holds large values that must not leak into the result."""
    gen = torch.Generator().manual_seed(b * 100 + w)
    q = bf16(b, kvh * g + kvh, d, gen=gen)[:, :kvh * g]  # rows of a wider tensor, as in the engine
    k, v = bf16(b, kvh, d, gen=gen), bf16(b, kvh, d, gen=gen)
    kt, vt = bf16(b, kvh, d, w, gen=gen, scale=1e4), bf16(b, kvh, w, d, gen=gen, scale=1e4)
    lens = torch.randint(1, w + 1, (b,), generator=gen, dtype=torch.int32)
    lens[0], lens[-1] = w, 1
    for row in range(b):
        kt[row, :, :, :lens[row]] /= 1e4
        vt[row, :, :lens[row]] /= 1e4
    kt_want, vt_want, want = kt.clone(), vt.clone(), torch.empty(b, kvh * g, d)
    for row in range(b):
        n = int(lens[row])
        kt_want[row, :, :, n - 1], vt_want[row, :, n - 1] = k[row], v[row]
        for h in range(kvh):
            scores = q[row, h * g:(h + 1) * g].float() @ kt_want[row, h, :, :n].float() * d ** -0.5
            want[row, h * g:(h + 1) * g] = torch.softmax(scores, -1) @ vt_want[row, h, :n].float()
    out = torch.empty(b, kvh * g, d, dtype=torch.bfloat16)
    bf16_kernels.slab_attention(q, k, v, kt, vt, lens, out, torch.empty(b * kvh * g * w), d ** -0.5)
    assert torch.equal(kt, kt_want) and torch.equal(vt, vt_want)
    assert close(out, want.to(torch.bfloat16), ulps=1)


def _generate(model, tok, kernels: str) -> tuple[LLMEngine, dict]:
    engine = LLMEngine(model, EngineConfig(kv_cache_mb=4, block_size=4, max_tokens_per_step=24, cpu_kernels=kernels))
    for i, text in enumerate(["12+34=", "7*8=56 and 9*9=", "hello world, count: 1 2 3", "x"]):
        engine.add_request(f"r{i}", tok.encode(text), SamplingParams(max_new_tokens=20 + 7 * i, temperature=1.0,
                                                                   ignore_eos=True, seed=i))
    outs = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = o.output
    return engine, outs


@needs_kernels
def test_a_bf16_engine_on_the_kernels_reports_the_logprobs_of_a_fresh_forward():
    tok = build_tiny_tokenizer(PRINTABLE)
    fp32 = load_model(ModelConfig(dtype="float32", tiny_alphabet=PRINTABLE, max_position=128), seed=0, tokenizer=tok)
    model = copy.deepcopy(fp32).to(torch.bfloat16)
    engine, outs = _generate(model, tok, "compiled")
    assert engine.runner.kernels is cpu_kernels.BF16
    _, torch_outs = _generate(model, tok, "torch")
    for rid, out in outs.items():
        ids = tok.encode(["12+34=", "7*8=56 and 9*9=", "hello world, count: 1 2 3", "x"][int(rid[1:])])
        with torch.no_grad():
            logits = fp32(torch.tensor([ids + out.output_ids])).logits[0].float()  # the fp32 policy's log-probs
        ref = torch.log_softmax(logits, -1)[torch.arange(len(ids) - 1, len(ids) - 1 + len(out.output_ids)),
                                            torch.tensor(out.output_ids)]
        err = (ref - torch.tensor(out.output_logprobs)).abs().max()
        assert err <= 0.05, (rid, float(err))
    # the kernels round once where torch rounds each op: the two bf16 paths sample the same tokens nearly always
    same = sum(a == b for rid in outs for a, b in zip(outs[rid].output_ids, torch_outs[rid].output_ids))
    assert same >= 0.9 * sum(len(o.output_ids) for o in outs.values())


@needs_kernels
def test_sample_draws_by_the_inverse_cdf_and_reports_full_softmax_logprobs():
    gen = torch.Generator().manual_seed(0)
    s, v = 24, 1000
    logits = 3 * torch.randn(s, v, generator=gen)
    inv_t = torch.tensor([0.0, 1.0, 0.5, 2.0] * 6)
    u = torch.rand(s, generator=gen)
    tokens, logprobs, lse = bf16_kernels.sample(logits, inv_t, u)
    scale = torch.where(inv_t > 0, inv_t, torch.ones(s))[:, None]
    log_p = torch.log_softmax(logits * scale, -1)
    cdf = (logits * scale).softmax(-1).double().cumsum(-1)
    want = torch.searchsorted(cdf, (u.double() * cdf[:, -1])[:, None], right=True)[:, 0]
    want = torch.where(inv_t > 0, want, logits.argmax(-1))
    assert torch.equal(tokens, want)
    assert torch.allclose(logprobs, log_p.gather(1, tokens[:, None])[:, 0], atol=1e-5)
    assert torch.allclose(lse, torch.logsumexp(logits * scale, -1), atol=1e-5)


@needs_kernels
def test_sample_frequencies_follow_the_softmax():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, -30.0] + [-5.0] * 20])  # [1, 25]
    n = 20000
    u = torch.rand(n, generator=torch.Generator().manual_seed(1))
    tokens, _, _ = bf16_kernels.sample(logits.expand(n, -1).contiguous(), torch.full((n,), 1 / 0.8), u)  # T 0.8
    freq = torch.bincount(tokens, minlength=25).float() / n
    assert torch.allclose(freq, torch.softmax(logits[0] / 0.8, -1), atol=0.012)


@needs_kernels
def test_the_compiled_sampler_keeps_seeded_requests_batch_independent():
    tok = build_tiny_tokenizer(PRINTABLE)
    model = load_model(ModelConfig(dtype="bfloat16", tiny_alphabet=PRINTABLE, max_position=128), seed=0, tokenizer=tok)

    def run(prompts: dict) -> dict:
        engine = LLMEngine(model, EngineConfig(kv_cache_mb=4, block_size=4, cpu_kernels="compiled"))
        assert engine.sampler.kernel is bf16_kernels.sample
        for rid, text in prompts.items():
            engine.add_request(rid, tok.encode(text), SamplingParams(max_new_tokens=16, temperature=1.0,
                                                                    ignore_eos=True, seed=7))
        outs = {}
        while engine.has_unfinished():
            outs.update({o.request_id: o.output.output_ids for o in engine.step() if o.finished})
        return outs
    alone = run({"a": "12+34="})
    crowd = run({"a": "12+34=", "b": "hello", "c": "7*8=", "d": "count 1 2 3"})
    assert alone["a"] == crowd["a"] and len(set(crowd["b"])) > 3
