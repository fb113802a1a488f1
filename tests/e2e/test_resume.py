"""`async-rl run --resume RUN_DIR`: a run killed with SIGKILL continues from its newest checkpoint
and trains exactly what the uninterrupted run trains.

Sync mode with the same seed is deterministic here (each request's sampling seed derives from
the run seed, the sample and its index in the group), so the resumed run must reproduce the
uninterrupted run's losses step for step after the resume point: the trainer restores weights,
optimizer, policy version and RNG, and the fresh rollout side joins at the trainer's version,
loads its weights and continues the data stream where the checkpoint left it (one sample per
group already counted).
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from safetensors.torch import load_file

from async_rl.utils.ledger import audit
from tests.e2e.clitools import running
from tests.e2e.test_supervision import _finish, _output, _pid, _start, _wait_for
from tests.e2e.test_supervision import _rows as _sup_rows

ROOT = Path(__file__).resolve().parents[2]
DEBUG = str(ROOT / "configs" / "debug_cpu.yaml")
STEPS = 8
ARGS = ["mode=sync", f"total_steps={STEPS}", "trainer.checkpoint_every=1", "model.dtype=float32",
        "trainer.compute_dtype=float32", "log.progress=false", "task.eval_size=16"]


def _cli(*args: str, stdout=subprocess.PIPE) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "async_rl.launch.cli", *args], cwd=ROOT, stdout=stdout,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def _rows(run_dir: Path) -> dict[int, dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {r["step"]: r for r in rows}


def test_resume_after_sigkill_trains_what_the_uninterrupted_run_trains(tmp_path):
    # the uninterrupted run beside the one killed: sync mode trains the same whatever the timing
    full = _cli("run", "--config", DEBUG, *ARGS, f"run_dir={tmp_path / 'full'}", stdout=subprocess.DEVNULL)
    run = tmp_path / "killed"
    try:
        victim = _cli("run", "--config", DEBUG, *ARGS, f"run_dir={run}")
        try:
            deadline = time.monotonic() + 300
            while not (run / "checkpoints" / "step_000003" / "meta.json").is_file():
                assert victim.poll() is None and time.monotonic() < deadline, victim.stderr.read()[-3000:]
                time.sleep(0.1)
        finally:
            os.killpg(victim.pid, signal.SIGKILL)
            victim.wait(30)
        resumed = _cli("run", "--resume", str(run))
        out, err = resumed.communicate(timeout=400)
        assert resumed.returncode == 0, err[-3000:]
        _, err = full.communicate(timeout=400)
        assert full.returncode == 0, err[-3000:]
    finally:
        if full.poll() is None:
            os.killpg(full.pid, signal.SIGKILL)

    log = (run / "logs" / "trainer.log").read_text()
    start = int(log.split("resumed from ")[1].split("step ")[1].split(",")[0])
    assert 3 <= start < STEPS
    want, got = _rows(tmp_path / "full"), _rows(run)
    assert sorted(got) == list(range(STEPS))  # the steps redone after the checkpoint are logged once
    for step in range(start, STEPS):
        w, g = want[step], got[step]
        # the same trajectories (rewards of 64 samples agree exactly) and the same update: the loss to
        # 1e-6, the gradient norm to float noise (the engine's fresh KV cache reorders some sums)
        assert g["train/reward_mean"] == w["train/reward_mean"], step
        assert abs(g["train/loss"] - w["train/loss"]) <= 1e-6, (step, g["train/loss"], w["train/loss"])
        assert abs(g["train/grad_norm"] - w["train/grad_norm"]) <= 1e-5 * max(1.0, w["train/grad_norm"]), step
    final = f"checkpoints/step_{STEPS:06d}/model.safetensors"
    a, b = load_file(str(tmp_path / "full" / final)), load_file(str(run / final))
    assert max((a[k] - b[k]).abs().max().item() for k in a) <= 1e-4
    assert "joining a run in progress" in (run / "logs" / "rollout.log").read_text()


def test_a_rollout_side_that_joins_a_trainer_still_loading_its_checkpoint_waits_for_its_state(tmp_path):
    """The trainer killed mid-run restarts with a slow checkpoint load (`slow_resume.py`), and the rollout side
    restarted with it says HELLO meanwhile. The queue answers no HELLO before the state is loaded: the side
    joins at the restored version with the consumed prompts, keeps its outbox and its eval.jsonl, and nothing
    is trained twice. (Answered at once, it was told version 0 and nothing consumed: it threw away the groups
    sampled since, and generated the committed prompts again.)"""
    steps = 5
    proc = _start(tmp_path, f"total_steps={steps}", "trainer.batch_size=32", "trainer.checkpoint_every=2",
                  "trainer.checkpoint_budget=0", "agent.modules=[tests.e2e.slow_resume]")
    try:
        _wait_for(lambda: len(_sup_rows(tmp_path / "metrics.jsonl")) >= 3
                  and (tmp_path / "checkpoints" / "step_000002" / "meta.json").is_file(), proc, why="3 steps")
        pid = _pid(tmp_path, "trainer")
        trained = max(r["policy_version"] for r in _sup_rows(tmp_path / "metrics.jsonl"))  # at least, by the kill
        os.kill(pid, signal.SIGKILL)
        _wait_for(lambda: not running(pid), proc, why="the trainer gone")
        _finish(proc, timeout=400)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    out, err = _output(proc)
    assert proc.returncode == 0, err[-3000:]
    trainer_log = (tmp_path / "logs" / "trainer.log").read_text()
    resumed = int(trainer_log.split("resumed from ")[1].split("step ")[1].split(",")[0])
    assert resumed >= 2, trainer_log[-2000:]
    rollout_log = (tmp_path / "logs" / "rollout.log").read_text()
    assert f"joining a run in progress at version {resumed}" in rollout_log, rollout_log[-3000:]
    assert "discarded" not in rollout_log  # nothing of its outbox taken for a discarded future
    evals = [json.loads(line)["when"] for line in (tmp_path / "eval.jsonl").read_text().splitlines()]
    assert evals[0] == "before" and evals[-1] == "after", evals  # the first side's "before" kept
    audited = audit([tmp_path])
    # none trained twice; a step the killed trainer trained past its checkpoint was redone, and its trajectories
    # were rolled back (the kill can also come right after a checkpoint: then there is nothing to roll back)
    assert audited.ok and (audited.rolled_back > 0 or trained <= resumed), audited.lines()
