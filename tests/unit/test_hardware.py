"""Devices and dtypes: `auto` picks bf16 only where it is native; bad devices name the key."""

import os
import subprocess
import sys

import pytest
import torch

from async_rl.config import ModelConfig, TrainerConfig
from async_rl.models import build_tiny_tokenizer, load_model
from async_rl.utils import hardware
from async_rl.utils.hardware import DeviceError, resolve_device, resolve_dtype


def test_cpu_without_avx512_gets_float32_without_probing(monkeypatch):
    monkeypatch.setattr(hardware, "cpu_capability", lambda: "AVX2")
    monkeypatch.setattr(hardware, "cpu_bf16_speedup", lambda: pytest.fail("AVX2 must not need a probe"))
    choice = resolve_dtype("auto", "cpu")
    assert choice.dtype == torch.float32
    assert "AVX2" in choice.reason


@pytest.mark.parametrize("speedup,expected", [(0.004, torch.float32), (1.0, torch.float32), (2.7, torch.bfloat16)])
def test_avx512_cpu_follows_the_measured_probe(monkeypatch, speedup, expected):
    monkeypatch.setattr(hardware, "cpu_capability", lambda: "AVX512")
    monkeypatch.setattr(hardware, "cpu_flags", lambda: {"avx512f", "avx512_bf16"})
    monkeypatch.setattr(hardware, "cpu_bf16_speedup", lambda: speedup)
    choice = resolve_dtype("auto", "cpu")
    assert choice.dtype == expected
    assert "measured" in choice.reason


def test_avx512_without_bf16_instructions_gets_float32(monkeypatch):
    monkeypatch.setattr(hardware, "cpu_capability", lambda: "AVX512")
    monkeypatch.setattr(hardware, "cpu_flags", lambda: {"avx512f", "avx512bw"})
    monkeypatch.setattr(hardware, "cpu_bf16_speedup", lambda: pytest.fail("no bf16 instructions: no probe"))
    assert resolve_dtype("auto", "cpu").dtype == torch.float32


def _native_bf16() -> bool:
    return hardware.cpu_capability().upper().startswith("AVX512") and bool(
        hardware.cpu_flags() & {"avx512_bf16", "amx_bf16"})


def test_probe_measures_this_machine():
    """bf16 beats fp32 by the margin `auto` asks for where the CPU multiplies bf16 natively, and loses
    by as much where it is emulated: the same probe in a child whose kernels are held to AVX2 (as on an
    AVX2-only CPU) must see bf16 slower. A probe that timed one dtype twice would read ~1 and fail."""
    margin = hardware._BF16_MIN_SPEEDUP
    speedup = hardware.cpu_bf16_speedup()
    assert speedup >= margin if _native_bf16() else speedup <= 1 / margin, (speedup, hardware.cpu_capability())
    avx2 = {"ATEN_CPU_CAPABILITY": "avx2", "DNNL_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
    child = subprocess.run([sys.executable, "-c", "from async_rl.utils import hardware\n"
                            "print(hardware.cpu_capability(), hardware.cpu_bf16_speedup())"],
                           capture_output=True, text=True, timeout=120, env={**os.environ, **avx2}, check=True)
    capability, emulated = child.stdout.split()
    assert capability == "AVX2" and float(emulated) <= 1 / margin, child.stdout


def test_explicit_dtype_is_kept_and_bad_one_named():
    assert resolve_dtype("float32").dtype == torch.float32
    assert resolve_dtype("bfloat16").dtype == torch.bfloat16
    with pytest.raises(ValueError, match="dtype"):
        resolve_dtype("float8")


def test_devices():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(DeviceError, match="engine.device"):
        resolve_device("tpu", "engine.device")
    if not torch.cuda.is_available():
        with pytest.raises(DeviceError, match="trainer.device: 'cuda:0' asked for"):
            resolve_device("cuda:0", "trainer.device")


def test_load_model_in_auto_dtype_matches_the_choice():
    tok = build_tiny_tokenizer("01+=")
    model = load_model(ModelConfig(dtype="auto", tiny_alphabet="01+="), seed=0, tokenizer=tok)
    assert next(model.parameters()).dtype == resolve_dtype("auto", "cpu").dtype


@pytest.mark.gpu
def test_engine_and_trainer_on_cuda():
    from async_rl.config import EngineConfig
    from async_rl.engine.llm_engine import LLMEngine
    from async_rl.trainer.trainer import PPOTrainer
    from async_rl.types import SamplingParams

    tok = build_tiny_tokenizer("01+=")
    model = load_model(ModelConfig(dtype="float32", tiny_alphabet="01+="), seed=0, tokenizer=tok, device="cuda")
    engine = LLMEngine(model, EngineConfig(kv_cache_mb=8, block_size=8), tokenizer=tok, eos_token_ids=[2])
    engine.add_request("r", tok.encode("1+1="), SamplingParams(max_new_tokens=4, temperature=1.0, seed=1))
    done = []
    while engine.has_unfinished():
        done += [o for o in engine.step() if o.finished]
    assert len(done[0].output.output_ids) >= 1
    trainer = PPOTrainer(model, TrainerConfig(compute_dtype="auto"), temperature=1.0, max_staleness=0, seed=0)
    assert trainer.device.type == "cuda"
    assert all(t.device.type == "cpu" for t in trainer.state_dict().values())  # published from GPU to any engine
