"""`async-rl run` with the FSDP2 trainer backend on the tiny debug config, as a user runs it."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DEBUG = str(ROOT / "configs" / "debug_cpu.yaml")


def cli(*args: str, timeout: float = 400) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "async_rl.launch.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.slow
def test_run_with_fsdp_trainer_of_two_ranks_completes(tmp_path):
    steps = 3
    res = cli("run", "--config", DEBUG, f"run_dir={tmp_path}", "trainer.backend=fsdp", "trainer.world_size=2",
              f"total_steps={steps}", "log.progress=false")
    assert res.returncode == 0, res.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["policy_version"] for r in rows] == list(range(1, steps + 1))
    assert all(r["train/num_tokens"] > 0 and r["train/optimizer_steps"] == 1 for r in rows)
    assert (tmp_path / "checkpoints" / f"step_{steps:06d}" / "model.safetensors").is_file()
    assert "greedy accuracy" in res.stdout
    # rank 1 ran as a child of the trainer and left when rank 0 said stop
    rank1 = (tmp_path / "logs" / "trainer_rank1.log").read_text()
    assert "fsdp rank 1/2" in rank1 and "stop after" in rank1
    assert not (tmp_path / "logs" / "trainer_rank1.error").exists()


def test_world_size_beyond_the_machine_stops_the_run_with_one_line(tmp_path):
    too_many = len(os.sched_getaffinity(0)) + 1
    res = cli("run", "--config", DEBUG, f"run_dir={tmp_path}", "trainer.backend=fsdp",
              f"trainer.world_size={too_many}", "total_steps=3", "log.progress=false", timeout=180)
    assert res.returncode == 2
    errors = [line for line in res.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, res.stderr[-3000:]
    assert f"trainer.world_size: {too_many} CPU ranks need at least {too_many} cores" in errors[0]
