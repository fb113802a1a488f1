"""Reproducible sampling: each request's seed comes from (run seed, sample id, index in the group), so
async at max_staleness=0 trains on exactly the trajectories sync does, whatever the batching timing."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _start(run_dir: Path, *overrides: str) -> subprocess.Popen:
    # same threads in both modes (pinned pools), so the two runs differ only in mode
    return subprocess.Popen([sys.executable, "-m", "async_rl.launch.cli", "run", "--config", "configs/debug_cpu.yaml",
                             f"run_dir={run_dir}", "total_steps=3", "seed=7", "log.progress=false",
                             "log.trajectories=true", "model.dtype=float32", "trainer.compute_dtype=float32",
                             "rollout.max_new_tokens=3", "cores.engine=[0]", "cores.trainer=[1]", *overrides],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _by_step(run_dir: Path) -> dict[int, list[tuple]]:
    out: dict[int, list[tuple]] = {}
    for line in (run_dir / "trajectories.jsonl").read_text().splitlines():
        r = json.loads(line)
        out.setdefault(r["step"], []).append((r["sample_id"], r["response_ids"], r["versions"], r["reward"],
                                              r["behav_logprobs"]))
    return {k: sorted(v, key=lambda x: (x[0], x[1])) for k, v in out.items()}


def test_async_eta0_trains_the_trajectories_sync_does(tmp_path):
    # both at once: what either trains does not depend on timing, which is the point
    runs = [_start(tmp_path / "async", "mode=async", "max_staleness=0"), _start(tmp_path / "sync", "mode=sync")]
    try:
        for run in runs:
            _, err = run.communicate(timeout=600)
            assert run.returncode == 0, err[-3000:]
    finally:
        for run in runs:
            run.kill()
    a, s = _by_step(tmp_path / "async"), _by_step(tmp_path / "sync")
    assert sorted(a) == sorted(s) == [0, 1, 2]
    for step in a:
        assert len(a[step]) == len(s[step]) == 64
        for x, y in zip(a[step], s[step]):
            assert x[:4] == y[:4]  # sample, tokens, versions, reward
            assert max(abs(p - q) for p, q in zip(x[4], y[4])) < 1e-5  # log-probs up to batching round-off
    la = [json.loads(r)["train/loss"] for r in (tmp_path / "async" / "metrics.jsonl").read_text().splitlines()]
    ls = [json.loads(r)["train/loss"] for r in (tmp_path / "sync" / "metrics.jsonl").read_text().splitlines()]
    assert max(abs(p - q) for p, q in zip(la, ls)) < 1e-5
