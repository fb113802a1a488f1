"""`async-rl run` supervises its processes: kill -9 one mid-run and the run still completes.

Each test starts `async-rl run` on the debug config as a user would, kills one process with
SIGKILL at a moment read from the run directory (the generation server's pid from servers.json,
the rollout's and the trainer's from logs/NAME.pid), and checks that the run finishes with
exit code 0 and every train step, that every step after the kill trained on data, and that
the restart is recorded in restarts.jsonl and the summary, and that the ledger's audit finds
nothing lost and nothing trained twice. A component that crashes every time exhausts its
budget and fails the run with one line; SIGTERM drains and exits 143.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from async_rl.trainer.checkpoint import latest_checkpoint
from async_rl.utils.ledger import audit

ROOT = Path(__file__).resolve().parents[2]
DEBUG = str(ROOT / "configs" / "debug_cpu.yaml")
FAST = ["log.progress=false", "supervise.restart_backoff_s=0.2", "transport.heartbeat_s=0.5",
        "rollout.health_interval_s=1", "task.eval_size=8"]


def _rows(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _start(run_dir: Path, *overrides: str) -> subprocess.Popen:
    # output to files, not pipes: nobody reads a pipe while the test waits, and a full one blocks the run
    run_dir.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen([sys.executable, "-m", "launch.cli", "run", "--config", DEBUG, f"run_dir={run_dir}",
                             *FAST, *overrides], cwd=ROOT, stdout=(run_dir / "stdout.txt").open("w"),
                            stderr=(run_dir / "stderr.txt").open("w"), text=True, start_new_session=True)
    proc.run_dir = run_dir
    return proc


def _output(proc: subprocess.Popen) -> tuple[str, str]:
    return (proc.run_dir / "stdout.txt").read_text(), (proc.run_dir / "stderr.txt").read_text()


def _wait_for(what, proc: subprocess.Popen, timeout: float = 240.0, why: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not what():
        if proc.poll() is not None:
            out, err = _output(proc)
            raise AssertionError(f"run ended ({proc.returncode}) before {why}:\n{out[-2000:]}\n{err[-3000:]}")
        assert time.monotonic() < deadline, f"not {why} after {timeout:.0f}s"
        time.sleep(0.1)


def _finish(proc: subprocess.Popen, timeout: float = 300.0) -> tuple[str, str]:
    try:
        proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return _output(proc)


def _kill(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"  # a zombie has exited; whoever reaps it does not matter here


def _check_completed(run_dir: Path, proc: subprocess.Popen, out: str, err: str, steps: int, killed_at: int,
                     component: str) -> None:
    assert proc.returncode == 0, f"{out[-2000:]}\n{err[-3000:]}"
    rows = _rows(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(steps)), [r["step"] for r in rows]
    assert rows[-1]["policy_version"] == steps
    # every step after the restart trained on data (a batch dropped whole is no step)
    assert all(r["train/num_trajectories"] > 0 for r in rows[killed_at:]), [r["train/num_trajectories"] for r in rows]
    # the kill is recorded (on a busy machine another component may need a restart too: a health check
    # that timed out can leave a weight update without a server, and the rollout process then restarts)
    restarts = [r for r in _rows(run_dir / "restarts.jsonl") if r["counted"] and r["component"] == component]
    assert len(restarts) == 1 and restarts[0]["cause"] == "killed by SIGKILL", _rows(run_dir / "restarts.jsonl")
    assert "restarts: " in out and f"{component} 1" in out, out
    ledger = audit([run_dir])  # nothing produced was lost, nothing trained twice
    assert not ledger.lost_ids and not ledger.duplicated_ids, ledger.lines()
    # nothing produced was lost (outbox, rejoin) and nothing trained twice (dedup, rollback on resume)
    audited = subprocess.run([sys.executable, "-m", "launch.cli", "audit", str(run_dir)], cwd=ROOT,
                             capture_output=True, text=True, timeout=60)
    assert audited.returncode == 0 and "lost=0 duplicated=0" in audited.stdout, audited.stdout + audited.stderr


def test_generation_server_killed_is_restarted_on_its_port(tmp_path):
    steps = 6
    proc = _start(tmp_path, f"total_steps={steps}")
    try:
        # right after a weight update finished: the next one is a train step away
        _wait_for(lambda: sum("sync/update_s" in r for r in _rows(tmp_path / "rollout_metrics.jsonl")) >= 2,
                  proc, why="two weight updates")
        before = json.loads((tmp_path / "servers.json").read_text())[0]
        killed_at = len(_rows(tmp_path / "metrics.jsonl"))
        _kill(before["pid"])
        out, err = _finish(proc)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    _check_completed(tmp_path, proc, out, err, steps, killed_at, "server0")
    after = json.loads((tmp_path / "servers.json").read_text())[0]
    assert after["url"] == before["url"] and after["pid"] != before["pid"]
    log = (tmp_path / "logs" / "rollout.log").read_text()
    assert "restarted and back in rotation at weight version" in log, log[-3000:]
    assert not (tmp_path / "logs" / "rollout.error").is_file()  # the rollout process itself never died


def test_rollout_process_killed_is_restarted_and_rejoins(tmp_path):
    steps = 6
    proc = _start(tmp_path, f"total_steps={steps}")
    try:
        _wait_for(lambda: len(_rows(tmp_path / "metrics.jsonl")) >= 2, proc, why="two train steps")
        first = int((tmp_path / "logs" / "rollout.pid").read_text())
        killed_at = len(_rows(tmp_path / "metrics.jsonl"))
        _kill(first)
        out, err = _finish(proc)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    _check_completed(tmp_path, proc, out, err, steps, killed_at, "rollout")
    assert int((tmp_path / "logs" / "rollout.pid").read_text()) != first
    assert "joining a run in progress at version" in (tmp_path / "logs" / "rollout.log").read_text()


def test_trainer_killed_resumes_from_its_checkpoint(tmp_path):
    steps = 6
    proc = _start(tmp_path, f"total_steps={steps}", "trainer.checkpoint_every=1")
    try:
        _wait_for(lambda: latest_checkpoint(tmp_path / "checkpoints") is not None
                  and len(_rows(tmp_path / "metrics.jsonl")) >= 2, proc, why="a checkpoint after two steps")
        _kill(int((tmp_path / "logs" / "trainer.pid").read_text()))
        killed_at = len(_rows(tmp_path / "metrics.jsonl"))
        out, err = _finish(proc)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    # the resumed trainer trains again the steps after its checkpoint: rows from the kill on may be redone
    _check_completed(tmp_path, proc, out, err, steps, min(killed_at, steps) - 1, "trainer")
    forced = [r["component"] for r in _rows(tmp_path / "restarts.jsonl") if not r["counted"]]
    assert forced == ["rollout"]  # a fresh rollout side joins the restored trainer
    assert "resumed from" in (tmp_path / "logs" / "trainer.log").read_text()


def test_component_that_keeps_crashing_exhausts_the_budget(tmp_path):
    proc = _start(tmp_path, "total_steps=2", "supervise.max_restarts=1", "rollout.server_addrs=[not-a-url]")
    out, err = _finish(proc, timeout=200)
    assert proc.returncode == 2, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: rollout: ") and "rollout.server_addrs" in last, err[-3000:]
    assert "restarted 1 times already, the most supervise.max_restarts=1 allows" in last, last
    assert [r["component"] for r in _rows(tmp_path / "restarts.jsonl")] == ["rollout"]


def test_sigterm_drains_and_exits_143(tmp_path):
    proc = _start(tmp_path, "total_steps=40")
    try:
        _wait_for(lambda: len(_rows(tmp_path / "metrics.jsonl")) >= 2, proc, why="two train steps")
        pids = [int((tmp_path / "logs" / f"{name}.pid").read_text()) for name in ("trainer", "rollout")]
        pids += [s["pid"] for s in json.loads((tmp_path / "servers.json").read_text())]
        proc.send_signal(signal.SIGTERM)
        out, err = _finish(proc, timeout=200)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 143, err[-3000:]
    assert "stopped on SIGTERM after draining" in err, err[-3000:]
    assert not _rows(tmp_path / "restarts.jsonl")  # what stops while draining is not restarted
    deadline = time.monotonic() + 20
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(_alive(p) for p in pids)
    ckpt = latest_checkpoint(tmp_path / "checkpoints")
    # the trainer finished the step it was in, checkpointed it, and told the rollout side to stop
    rows = _rows(tmp_path / "metrics.jsonl")
    assert ckpt is not None and ckpt.name == f"step_{len(rows):06d}", (ckpt, len(rows))
    assert 2 <= len(rows) < 40
    assert f"newest checkpoint {ckpt}" in err
    assert "trainer finished at version" in (tmp_path / "logs" / "rollout.log").read_text()
