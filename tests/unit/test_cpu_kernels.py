"""The compiled decode kernels (async_rl/engine/cpu_kernels.py): the GEMM equal to F.linear on every tile shape
and remainder, the slab attention equal to softmax attention over each row's own keys, chosen by
engine.cpu_kernels, and a clear error where they cannot be built."""

import pytest
import torch
import torch.nn.functional as F

from async_rl.config import EngineConfig, ModelConfig
from async_rl.engine import bf16_kernels, cpu_kernels
from async_rl.engine.llm_engine import LLMEngine
from async_rl.models import PRINTABLE, build_tiny_tokenizer, load_model
from async_rl.types import SamplingParams

ok, why = cpu_kernels.available()
needs_kernel = pytest.mark.skipif(not ok, reason=f"compiled kernel unavailable: {why}")


@needs_kernel
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 7, 128])
@pytest.mark.parametrize("n,k", [(1, 8), (3, 64), (4, 64), (9, 576), (130, 1536)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_kernel_equals_f_linear(m, n, k, with_bias):
    """Every x-row tile (3, and the 1- and 2-row remainders), weight-row tile (4, and the 1-row remainder of
    N % 4), and a bias; fp32 sums in another order than oneDNN's: within 1e-5 of each output's scale."""
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if with_bias else None
    got, want = cpu_kernels.linear(x, w, b), F.linear(x, w, b)
    scale = (x.abs() @ w.abs().T).clamp_min(1.0)
    assert got.shape == want.shape
    assert ((got - want).abs() / scale).max() <= 1e-5


@needs_kernel
def test_kernel_reads_strided_inputs_and_k_not_a_multiple_of_8():
    x = torch.randn(6, 40)[:, :36]  # a view with a row stride of 40: copied, not misread
    w = torch.randn(5, 36)
    assert torch.allclose(cpu_kernels.linear(x, w), F.linear(x, w), atol=1e-5)  # K % 8 != 0: torch's kernel
    x8, w8 = torch.randn(8, 48)[::2], torch.randn(12, 64)[:, :48]
    assert torch.allclose(cpu_kernels.linear(x8, w8), F.linear(x8, w8), atol=1e-5)


@needs_kernel
@pytest.mark.parametrize("choice", ["compiled", "torch"])
def test_engine_picks_the_kernels_by_name_and_logprobs_match_a_fresh_forward(choice):
    tok = build_tiny_tokenizer(PRINTABLE)
    model = load_model(ModelConfig(dtype="float32", tiny_alphabet=PRINTABLE, max_position=128), seed=0, tokenizer=tok)
    engine = LLMEngine(model, EngineConfig(kv_cache_mb=2, block_size=4, max_tokens_per_step=32, cpu_kernels=choice))
    assert (engine.runner.gate_up[0].small is cpu_kernels.linear) == (choice == "compiled")
    assert (engine.runner.kernels is cpu_kernels.COMPILED) == (choice == "compiled")
    prompt = tok.encode("12+34=")
    engine.add_request("r", prompt, SamplingParams(max_new_tokens=12, temperature=1.0, ignore_eos=True, seed=1))
    out = None
    while engine.has_unfinished():
        for o in engine.step():
            out = o.output if o.finished else out
    with torch.no_grad():
        logits = model(torch.tensor([prompt + out.output_ids])).logits[0]
    ref = torch.log_softmax(logits, -1)[torch.arange(len(prompt) - 1, len(prompt) - 1 + len(out.output_ids)),
                                        torch.tensor(out.output_ids)]
    assert (ref - torch.tensor(out.output_logprobs)).abs().max() <= 1e-4


def test_auto_uses_the_kernels_on_fp32_avx2_and_bf16_avx512_cpus():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    capability = torch.backends.cpu.get_cpu_capability()
    bf16_ok = bf16_kernels.available()[0]
    assert (cpu_kernels.cpu_kernels("auto", cpu, torch.bfloat16) is cpu_kernels.BF16) == (capability == "AVX512"
                                                                                           and bf16_ok)
    assert cpu_kernels.cpu_kernels("auto", cpu, torch.float16) is None
    assert cpu_kernels.cpu_kernels("auto", cuda, torch.float32) is None
    assert cpu_kernels.cpu_kernels("torch", cpu, torch.float32) is None
    assert cpu_kernels.cpu_kernels("torch", cpu, torch.bfloat16) is None
    assert (cpu_kernels.cpu_kernels("auto", cpu, torch.float32) is cpu_kernels.COMPILED) == (capability == "AVX2"
                                                                                             and ok)
    with pytest.raises(ValueError, match="engine.cpu_kernels: 'compiled' runs fp32 or bf16 on a CPU"):
        cpu_kernels.cpu_kernels("compiled", cpu, torch.float16)
    with pytest.raises(ValueError, match="engine.cpu_kernels: unknown 'fast'; registered: auto, compiled, torch"):
        cpu_kernels.cpu_kernels("fast", cpu, torch.float32)


def test_without_a_compiler_compiled_is_refused_naming_why_and_auto_falls_back(tmp_path, monkeypatch):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("ASYNC_RL_KERNEL_DIR", str(tmp_path / "kernels"))  # nothing cached there
    cpu_kernels._load.cache_clear()
    bf16_kernels._load.cache_clear()
    try:
        if not cpu_kernels._cpu_has_avx2():
            pytest.skip("the CPU lacks AVX2: the compiler is never asked")
        assert cpu_kernels.available() == (False, f"no C compiler ({str(tmp_path / 'no-such-cc')!r} not found; set CC)")
        with pytest.raises(ValueError, match="'compiled' cannot run here: no C compiler"):
            cpu_kernels.cpu_kernels("compiled", torch.device("cpu"), torch.float32)
        for dtype in (torch.float32, torch.bfloat16):
            assert cpu_kernels.cpu_kernels("auto", torch.device("cpu"), dtype) is None
        with pytest.raises(RuntimeError, match="the compiled kernels are not available: no C compiler"):
            cpu_kernels.linear(torch.randn(2, 8), torch.randn(3, 8))
        if bf16_kernels._cpu_has_avx512():
            with pytest.raises(ValueError, match="'compiled' cannot run here: no C compiler"):
                cpu_kernels.cpu_kernels("compiled", torch.device("cpu"), torch.bfloat16)
    finally:
        cpu_kernels._load.cache_clear()
        bf16_kernels._load.cache_clear()


@needs_kernel
def test_a_failing_build_names_the_compiler_error(tmp_path, monkeypatch):
    fake = tmp_path / "cc"
    fake.write_text("#!/bin/sh\necho 'fatal: no such option -mavx2' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("CC", str(fake))
    monkeypatch.setenv("ASYNC_RL_KERNEL_DIR", str(tmp_path / "kernels"))
    cpu_kernels._load.cache_clear()
    try:
        assert cpu_kernels.available() == (False, f"{fake} failed: fatal: no such option -mavx2")
    finally:
        cpu_kernels._load.cache_clear()


def _attention_reference(q, k, v, kt, vt, lens, scale):
    b_, heads, _ = q.shape
    kvh = kt.shape[1]
    g = heads // kvh
    kt, vt, out = kt.clone(), vt.clone(), torch.empty(q.shape)
    for b in range(b_):
        n = int(lens[b])
        kt[b, :, :, n - 1], vt[b, :, n - 1] = k[b], v[b]
        for h in range(kvh):
            scores = q[b, h * g:(h + 1) * g] @ kt[b, h, :, :n] * scale
            out[b, h * g:(h + 1) * g] = torch.softmax(scores, -1) @ vt[b, h, :n]
    return out, kt, vt


@needs_kernel
@pytest.mark.parametrize("b,kvh,g,d,w", [(5, 3, 3, 64, 64), (7, 2, 4, 128, 256), (3, 1, 7, 72, 96), (1, 1, 1, 8, 32)])
def test_slab_attention_writes_the_new_kv_and_attends_over_each_rows_own_keys(b, kvh, g, d, w):
    """Head dims of 64-vector blocks and 8-float remainders, GQA groups 1-7, rows from 1 key to the full width;
    the padding past a row's length holds large values that must not leak into the result."""
    gen = torch.Generator().manual_seed(b * 100 + w)
    q = torch.randn(b, kvh * g + kvh, d, generator=gen)[:, :kvh * g]  # rows of a wider tensor, as in the engine
    k, v = torch.randn(b, kvh, d, generator=gen), torch.randn(b, kvh, d, generator=gen)
    kt, vt = 1e4 * torch.randn(b, kvh, d, w, generator=gen), 1e4 * torch.randn(b, kvh, w, d, generator=gen)
    lens = torch.randint(1, w + 1, (b,), generator=gen, dtype=torch.int32)
    lens[0], lens[-1] = w, 1
    for row in range(b):  # keys the row holds are of normal size; past its length, padding of 1e4
        kt[row, :, :, :lens[row]] /= 1e4
        vt[row, :, :lens[row]] /= 1e4
    want, kt_want, vt_want = _attention_reference(q, k, v, kt, vt, lens, d ** -0.5)
    out, scratch = torch.empty(b, kvh * g, d), torch.empty(b * kvh * g * w)
    cpu_kernels.slab_attention(q, k, v, kt, vt, lens, out, scratch, d ** -0.5)
    assert torch.equal(kt, kt_want) and torch.equal(vt, vt_want)
    assert (out - want).abs().max() <= 1e-5


@needs_kernel
def test_slab_attention_refuses_layouts_it_cannot_read():
    q, k, v = torch.randn(2, 3, 64), torch.randn(2, 1, 64), torch.randn(2, 1, 64)
    kt, vt, lens = torch.zeros(2, 1, 64, 48), torch.zeros(2, 1, 48, 64), torch.tensor([1, 2], dtype=torch.int32)
    with pytest.raises(ValueError, match="W % 32 == 0"):
        cpu_kernels.slab_attention(q, k, v, kt, vt, lens, torch.empty(2, 3, 64), torch.empty(2 * 3 * 48), 0.1)
    with pytest.raises(ValueError, match="q must be fp32 rows of contiguous heads"):
        cpu_kernels.slab_attention(q.transpose(1, 2), k, v, kt, vt, lens, torch.empty(2, 3, 64),
                                   torch.empty(2 * 3 * 48), 0.1)
