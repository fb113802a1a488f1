"""`async-rl run --resume RUN_DIR` with the FSDP2 trainer of 2 ranks: a run killed with SIGKILL
continues from its newest checkpoint and trains what the uninterrupted run trains.

test_resume.py's scenario (sync mode, same seed: a deterministic data stream) with
`trainer.backend=fsdp trainer.world_size=2`: rank 0 announces the load, rank 1 (a fresh child
process) loads its own shard, both restore the same version and RNG.
"""

import os
import signal
import time

import pytest
from safetensors.torch import load_file

from tests.e2e.test_resume import ARGS as SINGLE_ARGS
from tests.e2e.test_resume import DEBUG, _cli, _rows

STEPS = 4
ARGS = [a for a in SINGLE_ARGS if not a.startswith("total_steps=")] + [
    f"total_steps={STEPS}", "trainer.backend=fsdp", "trainer.world_size=2"]


@pytest.mark.slow
def test_fsdp_run_resumed_after_sigkill_trains_what_the_uninterrupted_run_trains(tmp_path):
    full = _cli("run", "--config", DEBUG, *ARGS, f"run_dir={tmp_path / 'full'}")
    out, err = full.communicate(timeout=400)
    assert full.returncode == 0, err[-3000:]

    run = tmp_path / "killed"
    victim = _cli("run", "--config", DEBUG, *ARGS, f"run_dir={run}")
    try:
        deadline = time.monotonic() + 300
        while not (run / "checkpoints" / "step_000002" / "meta.json").is_file():
            assert victim.poll() is None and time.monotonic() < deadline, victim.stderr.read()[-3000:]
            time.sleep(0.1)
    finally:
        os.killpg(victim.pid, signal.SIGKILL)
        victim.wait(30)
    resumed = _cli("run", "--resume", str(run))
    out, err = resumed.communicate(timeout=400)
    assert resumed.returncode == 0, err[-3000:]

    log = (run / "logs" / "trainer.log").read_text()
    start = int(log.split("resumed from ")[1].split("step ")[1].split(",")[0])
    assert 2 <= start < STEPS
    assert f"fsdp rank 1/2: loaded its shard of {run}/checkpoints/step_{start:06d}" in \
        (run / "logs" / "trainer_rank1.log").read_text()
    want, got = _rows(tmp_path / "full"), _rows(run)
    assert sorted(got) == list(range(STEPS))
    for step in range(start, STEPS):
        w, g = want[step], got[step]
        assert g["train/reward_mean"] == w["train/reward_mean"], step
        assert abs(g["train/loss"] - w["train/loss"]) <= 1e-6, (step, g["train/loss"], w["train/loss"])
        assert abs(g["train/grad_norm"] - w["train/grad_norm"]) <= 1e-5 * max(1.0, w["train/grad_norm"]), step
    final = f"checkpoints/step_{STEPS:06d}/model.safetensors"
    a, b = load_file(str(tmp_path / "full" / final)), load_file(str(run / final))
    assert max((a[k] - b[k]).abs().max().item() for k in a) <= 1e-4
