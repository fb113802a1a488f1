"""A rollout side killed with SIGKILL mid-run and started again rejoins at the trainer's version.

The two-shell scenario of a user: `async-rl train` and `async-rl rollout` (weights over the
queue), `kill -9` of the whole rollout side (controller and its generation server) after a
few steps, then `async-rl rollout` again in a NEW run directory (the host was lost with its
disk, and the killed side's outbox with it). The new side is told the trainer's version,
accounting and the prompt positions it holds when it connects, receives the current weights
before it generates, regenerates the prompts the killed side admitted and never delivered, and
the run finishes with every train step after the restart training on data: no version is
spent on a batch that is dropped whole, and everything that arrived was within the bound. The
audit over all three directories finds nothing lost, no prompt skipped, nothing trained twice;
over the trainer's alone it says it cannot vouch for the sides. (The same-directory restart,
whose outbox sends again what was not committed, is tests/e2e/test_supervision.py's.)
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from async_rl.launch.common import free_port
from tests.e2e.admission import check_arrived, check_produced, gate_overrides

ROOT = Path(__file__).resolve().parents[2]
DEBUG = str(ROOT / "configs" / "debug_cpu.yaml")


def _rows(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _start(kind: str, *args: str, log: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "async_rl.launch.cli", kind, *args], cwd=ROOT, stdout=log.open("w"),
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
        # a new run directory, as after losing the host with its disk: the killed side's outbox is gone, so
        # what it admitted and never delivered must come back into the stream from the trainer's accounting
        second = _start("rollout", *common, f"run_dir={tmp_path / 'r2'}", log=tmp_path / "r2.log")
        assert train.wait(300) == 0, (tmp_path / "train.log").read_text()[-3000:]
        assert second.wait(60) == 0, (tmp_path / "r2.log").read_text()[-3000:]
    finally:
        for p in (train, first, second):
            if p is not None and p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    rows = _rows(tmp_path / "t" / "metrics.jsonl")
    # nor did the new side, joining with the trainer's accounting: every arrival of the run within the bound
    check_produced(_rows(tmp_path / "r2" / "rollout_metrics.jsonl"), eta=1, batch=64)
    check_arrived(rows, eta=1, batch=64)
    assert len(rows) == 14 and rows[-1]["policy_version"] == 14
    after = rows[killed_at:]
    # every step after the restart trained on data sampled within the staleness bound
    assert all(r["train/num_trajectories"] > 0 for r in after), [r["train/num_trajectories"] for r in after]
    assert all(r["train/staleness_max"] <= 1 for r in after)
    assert rows[-1]["train/skipped_batches"] <= 1
    # the new side was told where the run was and generated with the trainer's weights, not version 0
    log2 = (tmp_path / "r2" / "logs" / "rollout.log").read_text().split("joining a run in progress at version")
    assert len(log2) == 2, "the restarted side did not join at the trainer's version"
    loaded = [r["step"] for r in _rows(tmp_path / "r2" / "rollout_metrics.jsonl") if "sync/update_s" in r]
    assert loaded and max(loaded) >= killed_at, loaded
    # the trainer's directory alone cannot vouch for what the sides produced; with both sides' ledgers
    # nothing is lost: the killed side's undelivered groups are replaced (their prompts generated again
    # by the new side), no prompt of the stream is skipped, nothing is trained twice
    audit = [sys.executable, "-m", "async_rl.launch.cli", "audit"]
    alone = subprocess.run([*audit, str(tmp_path / "t")], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert alone.returncode == 1 and "incomplete: no rollout ledger" in alone.stdout, alone.stdout
    audited = subprocess.run([*audit, str(tmp_path / "t"), str(tmp_path / "r1"), str(tmp_path / "r2")],
                             cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert audited.returncode == 0 and "lost=0 duplicated=0 lost_prompts=0 duplicated_prompts=0" in audited.stdout, \
        audited.stdout + audited.stderr
    assert [e["when"] for e in _rows(tmp_path / "r2" / "eval.jsonl")].count("before") == 0  # joined mid-run
