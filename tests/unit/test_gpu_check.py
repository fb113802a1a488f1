"""benchmarks/gpu_check.py runs where a GPU is lent, rarely: its pieces are kept working here.

On CPU the script refuses with one line (it must never run the CPU suite on a GPU machine by
accident, nor pretend on a CPU one); its trainer-speed step runs on a tiny model of the same
Llama family, on CPU, through the same code (trajectories, PPO steps, a bf16 publish to disk).
"""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: the check would run")
def test_the_gpu_check_refuses_a_machine_without_cuda_in_one_line():
    p = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--out", "/nonexistent/never"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and p.stderr.startswith("error: gpu_check needs a CUDA GPU"), p.stderr
    assert len(p.stderr.strip().splitlines()) == 1


def test_the_trainer_speed_step_trains_and_publishes_a_random_llama(tmp_path):
    sys.path.insert(0, str(ROOT))
    from benchmarks.gpu_check import trainer_speed

    rec = trainer_speed(tmp_path, steps=2, batch=8, prompt=8, response=8, shape="tiny", device="cpu")
    assert rec["status"] == "ok" and rec["tokens_per_s"] > 0, rec
    published = list((tmp_path / "publish").rglob("*.safetensors"))
    assert published, "nothing was published"


def test_the_profile_step_times_decode_steps_of_a_random_llama(tmp_path):
    sys.path.insert(0, str(ROOT))
    from benchmarks.gpu_check import engine_profile

    rec = engine_profile(tmp_path, shape="tiny", device="cpu", requests=4, steps=3, top=5)
    assert rec["status"] == "ok" and rec["step_ms"] > 0, rec
    assert "by host time:" in rec["table"] and "aten::" in rec["table"], rec["table"]


def test_the_debug_runs_report_the_engines_step_times_by_batch():
    sys.path.insert(0, str(ROOT))
    from benchmarks.gpu_check import step_ms

    row = {"engine/step_t8_b2_n": 4.0, "engine/step_t8_b2_s": 0.2, "engine/step_t8_b16_n": 2.0,
           "engine/step_t8_b16_s": 0.05, "engine/step_t8_b4_n": 0.0, "engine/step_t8_b4_s": 0.0, "step": 3}
    assert step_ms(row) == {"b2": 50.0, "b16": 25.0}
