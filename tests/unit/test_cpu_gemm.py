"""The compiled decode GEMM (async_rl/engine/cpu_gemm.py): equal to F.linear on every tile shape and
remainder, chosen by engine.small_gemm, and a clear error where it cannot be built."""

import pytest
import torch
import torch.nn.functional as F

from async_rl.config import EngineConfig, ModelConfig
from async_rl.engine import cpu_gemm
from async_rl.engine.llm_engine import LLMEngine
from async_rl.models import PRINTABLE, build_tiny_tokenizer, load_model

ok, why = cpu_gemm.available()
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
    got, want = cpu_gemm.linear(x, w, b), F.linear(x, w, b)
    scale = (x.abs() @ w.abs().T).clamp_min(1.0)
    assert got.shape == want.shape
    assert ((got - want).abs() / scale).max() <= 1e-5


@needs_kernel
def test_kernel_reads_strided_inputs_and_k_not_a_multiple_of_8():
    x = torch.randn(6, 40)[:, :36]  # a view with a row stride of 40: copied, not misread
    w = torch.randn(5, 36)
    assert torch.allclose(cpu_gemm.linear(x, w), F.linear(x, w), atol=1e-5)  # K % 8 != 0: torch's kernel
    x8, w8 = torch.randn(8, 48)[::2], torch.randn(12, 64)[:, :48]
    assert torch.allclose(cpu_gemm.linear(x8, w8), F.linear(x8, w8), atol=1e-5)


@needs_kernel
@pytest.mark.parametrize("choice", ["compiled", "torch"])
def test_engine_picks_the_gemm_by_name_and_logprobs_match_a_fresh_forward(choice):
    tok = build_tiny_tokenizer(PRINTABLE)
    model = load_model(ModelConfig(dtype="float32", tiny_alphabet=PRINTABLE, max_position=128), seed=0, tokenizer=tok)
    engine = LLMEngine(model, EngineConfig(kv_cache_mb=2, block_size=4, max_tokens_per_step=32, small_gemm=choice))
    assert (engine.runner.gate_up[0].small is cpu_gemm.linear) == (choice == "compiled")
    prompt = tok.encode("12+34=")
    from async_rl.types import SamplingParams
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


def test_auto_uses_the_kernel_only_on_fp32_avx2_cpus():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert cpu_gemm.small_gemm("auto", cpu, torch.bfloat16) is None
    assert cpu_gemm.small_gemm("auto", cuda, torch.float32) is None
    assert cpu_gemm.small_gemm("torch", cpu, torch.float32) is None
    on_avx2 = torch.backends.cpu.get_cpu_capability() == "AVX2"
    assert (cpu_gemm.small_gemm("auto", cpu, torch.float32) is cpu_gemm.linear) == (on_avx2 and ok)
    with pytest.raises(ValueError, match="engine.small_gemm: 'compiled' runs fp32 on a CPU"):
        cpu_gemm.small_gemm("compiled", cpu, torch.bfloat16)
    with pytest.raises(ValueError, match="engine.small_gemm: unknown 'fast'; registered: auto, compiled, torch"):
        cpu_gemm.small_gemm("fast", cpu, torch.float32)


def test_without_a_compiler_compiled_is_refused_naming_why_and_auto_falls_back(tmp_path, monkeypatch):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("ASYNC_RL_KERNEL_DIR", str(tmp_path / "kernels"))  # nothing cached there
    cpu_gemm._load.cache_clear()
    try:
        if not cpu_gemm._cpu_has_avx2():
            pytest.skip("the CPU lacks AVX2: the compiler is never asked")
        assert cpu_gemm.available() == (False, f"no C compiler ({str(tmp_path / 'no-such-cc')!r} not found; set CC)")
        with pytest.raises(ValueError, match="'compiled' cannot run here: no C compiler"):
            cpu_gemm.small_gemm("compiled", torch.device("cpu"), torch.float32)
        assert cpu_gemm.small_gemm("auto", torch.device("cpu"), torch.float32) is None
        with pytest.raises(RuntimeError, match="the compiled kernel is not available: no C compiler"):
            cpu_gemm.linear(torch.randn(2, 8), torch.randn(3, 8))
    finally:
        cpu_gemm._load.cache_clear()


@needs_kernel
def test_a_failing_build_names_the_compiler_error(tmp_path, monkeypatch):
    fake = tmp_path / "cc"
    fake.write_text("#!/bin/sh\necho 'fatal: no such option -mavx2' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("CC", str(fake))
    monkeypatch.setenv("ASYNC_RL_KERNEL_DIR", str(tmp_path / "kernels"))
    cpu_gemm._load.cache_clear()
    try:
        assert cpu_gemm.available() == (False, f"{fake} failed: fatal: no such option -mavx2")
    finally:
        cpu_gemm._load.cache_clear()
