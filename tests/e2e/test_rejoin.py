"""A rollout side killed with SIGKILL mid-run and started again rejoins at the trainer's version.

The two-shell scenario of a user: `async-rl train` and `async-rl rollout` (weights over the
queue), `kill -9` of the whole rollout side (controller and its generation server) after a
few steps, then `async-rl rollout` again. The new side is told the trainer's version and
accounting when it connects, receives the current weights before it generates, and the run
finishes with every train step after the restart training on data: no version is spent on
a batch that is dropped whole, and what the trainer trains after the restart was sampled by
the current policy (staleness within the bound).
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from launch.common import free_port
from tests.e2e.admission import check_arrived, check_produced, gate_overrides

ROOT = Path(__file__).resolve().parents[2]
DEBUG = str(ROOT / "configs" / "debug_cpu.yaml")


def _rows(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _start(kind: str, *args: str, log: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "launch.cli", kind, *args], cwd=ROOT, stdout=log.open("w"),
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _wait_rows(path: Path, n: int, proc: subprocess.Popen, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while len(_rows(path)) < n:
        assert proc.poll() is None, f"trainer exited early ({proc.returncode})"
        assert time.monotonic() < deadline, f"fewer than {n} train steps after {timeout}s"
        time.sleep(0.2)


def test_rollout_side_killed_and_restarted_rejoins_at_the_current_version(tmp_path):
    addr = f"tcp://127.0.0.1:{free_port()}"
    common = ["--config", DEBUG, f"transport.addr={addr}", "total_steps=14", "weight_sync.transport=zmq",
              "log.progress=false", "transport.heartbeat_s=0.5", "transport.peer_timeout_s=3",
              "max_staleness=1", *gate_overrides()]
    train = _start("train", *common, f"run_dir={tmp_path / 't'}", log=tmp_path / "train.log")
    first = second = None
    try:
        first = _start("rollout", *common, f"run_dir={tmp_path / 'r1'}", log=tmp_path / "r1.log")
        _wait_rows(tmp_path / "t" / "metrics.jsonl", 5, train)
        os.killpg(first.pid, signal.SIGKILL)  # the controller and its server, as a lost node
        first.wait(10)
        killed_at = len(_rows(tmp_path / "t" / "metrics.jsonl"))
        # the killed side produced no more than the bound admits, and nothing arrived beyond it
        check_produced(_rows(tmp_path / "r1" / "rollout_metrics.jsonl"), eta=1, batch=64)
        check_arrived(_rows(tmp_path / "t" / "metrics.jsonl")[:killed_at], eta=1, batch=64)
        time.sleep(1.0)
        # the same run directory: its outbox holds what the killed side produced and never saw acknowledged
        second = _start("rollout", *common, f"run_dir={tmp_path / 'r1'}", log=tmp_path / "r2.log")
        assert train.wait(300) == 0, (tmp_path / "train.log").read_text()[-3000:]
        assert second.wait(60) == 0, (tmp_path / "r2.log").read_text()[-3000:]
    finally:
        for p in (train, first, second):
            if p is not None and p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    rows = _rows(tmp_path / "t" / "metrics.jsonl")
    # nor did the new side (what arrives after the kill includes the killed side's unacknowledged groups,
    # sent again outside the new side's gate, so arrivals are checked up to the kill only)
    check_produced(_rows(tmp_path / "r1" / "rollout_metrics.jsonl"), eta=1, batch=64)
    assert len(rows) == 14 and rows[-1]["policy_version"] == 14
    after = rows[killed_at:]
    # every step after the restart trained on data sampled within the staleness bound
    assert all(r["train/num_trajectories"] > 0 for r in after), [r["train/num_trajectories"] for r in after]
    assert all(r["train/staleness_max"] <= 1 for r in after)
    assert rows[-1]["train/skipped_batches"] <= 1
    # the new side was told where the run was and generated with the trainer's weights, not version 0
    log2 = (tmp_path / "r1" / "logs" / "rollout.log").read_text().split("joining a run in progress at version")
    assert len(log2) == 2, "the restarted side did not join at the trainer's version"
    loaded = [r["step"] for r in _rows(tmp_path / "r1" / "rollout_metrics.jsonl") if "sync/update_s" in r]
    assert loaded and max(loaded) >= killed_at, loaded
    # nothing the killed side produced was lost (its outbox sent it again), nothing was trained twice
    audited = subprocess.run([sys.executable, "-m", "launch.cli", "audit", str(tmp_path / "t"), str(tmp_path / "r1")],
                             cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert audited.returncode == 0 and "lost=0 duplicated=0" in audited.stdout, audited.stdout + audited.stderr
    assert [e["when"] for e in _rows(tmp_path / "r1" / "eval.jsonl")].count("before") == 1
