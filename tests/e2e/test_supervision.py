"""`async-rl run` supervises its processes: kill -9 one mid-run and the run still completes.

The tests start `async-rl run` on the debug config as a user would. One kills the generation
server, the rollout process and the trainer with SIGKILL twice each, in a random order and at
random moments (pids read where the run writes them: servers.json, logs/NAME.pid), and checks
that the run finishes with exit code 0 and every train step, that every step trained on data,
that each restart is recorded in restarts.jsonl and the summary, and that the ledger's audit
finds nothing lost and nothing trained twice (the seed of the order and the moments is in
every failure message). A component that keeps crashing exhausts its budget and fails the run
with one line (one that fails before its first start got through is not restarted at all:
tests/e2e/test_cli_errors.py); SIGTERM drains and exits 143.
"""

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from async_rl.trainer.checkpoint import latest_checkpoint
from async_rl.utils.ledger import audit
from tests.e2e.clitools import running

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
    proc = subprocess.Popen([sys.executable, "-m", "async_rl.launch.cli", "run", "--config", DEBUG, f"run_dir={run_dir}",
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


def _pid(run_dir: Path, component: str) -> int | None:
    """The current pid of a component, read where the run writes it; None while it is not there."""
    try:
        if component.startswith("server"):  # listed by the current rollout process (a killed one's may linger)
            entry = json.loads((run_dir / "servers.json").read_text())[int(component[6:])]
            return entry["pid"] if entry["rollout_pid"] == _pid(run_dir, "rollout") else None
        return int((run_dir / "logs" / f"{component}.pid").read_text())
    except (FileNotFoundError, ValueError, IndexError, KeyError):
        return None


def _check_server_port(run_dir: Path, kills: list[tuple[str, int]], url: str | None) -> None:
    """A killed server came back on its port (a restarted rollout process starts its servers anew)."""
    if kills and kills[-1][0] == "server0":
        assert json.loads((run_dir / "servers.json").read_text())[0]["url"] == url, kills


def _steps_past_checkpoint(run_dir: Path) -> int:
    """Train steps logged since the newest checkpoint: what a trainer killed now must train again."""
    ckpt = latest_checkpoint(run_dir / "checkpoints")
    return len(_rows(run_dir / "metrics.jsonl")) - (int(ckpt.name[5:]) if ckpt else 0)


def test_random_kills_of_every_component_within_one_run(tmp_path):
    """kill -9 the generation server, the rollout process and the trainer twice each, in a random
    order and at random moments (each once the run has trained a step since the last kill), in one run.
    The checkpoint policy is the default one (a budget share of the trainer's time; a lower share
    here, so checkpoints come every few steps), and each trainer kill lands after a step that no
    checkpoint holds yet: the resumed trainer must train that data again, and does, once."""
    seed = time.time_ns() % 100_000
    rng = random.Random(seed)
    plan = ["server0", "rollout", "trainer"] * 2
    rng.shuffle(plan)
    steps = 32  # room for six kills, each after a new step: a run that ends first fails the test
    url = None
    proc = _start(tmp_path, f"total_steps={steps}", "trainer.checkpoint_budget=0.004")
    kills: list[tuple[str, int]] = []
    try:
        for component in plan:
            done = len(_rows(tmp_path / "metrics.jsonl")) if not kills else kills[-1][1]
            _wait_for(lambda: len(_rows(tmp_path / "metrics.jsonl")) > done
                      and all(running(_pid(tmp_path, c) or 0) for c in ("server0", "rollout", "trainer")), proc,
                      why=f"a step after kills {kills} and every component up (seed {seed}, plan {plan})")
            _check_server_port(tmp_path, kills, url)
            assert len(_rows(tmp_path / "metrics.jsonl")) < steps - 2, f"the run outran kills {kills} of {plan}"
            if component == "trainer":
                _wait_for(lambda: _steps_past_checkpoint(tmp_path) > 0, proc, why=f"a step past the checkpoint ({seed})")
            else:
                time.sleep(rng.uniform(0.0, 1.5))
            url = json.loads((tmp_path / "servers.json").read_text())[0]["url"]
            pid = _pid(tmp_path, component)
            _kill(pid)
            kills.append((component, len(_rows(tmp_path / "metrics.jsonl"))))
            # until it is gone, /proc shows a killed process as running: the next kill's "every component up"
            # would count it, and a kill of the same component would hit the dying one (no restart recorded)
            _wait_for(lambda: not running(pid), proc, why=f"{component} (pid {pid}) gone after kill -9 ({seed})")
        out, err = _finish(proc, timeout=400)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    where = f"seed {seed}, kills (component, steps done) {kills}"
    assert proc.returncode == 0, f"{where}\n{out[-2000:]}\n{err[-3000:]}"
    rows = _rows(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(steps)), (where, [r["step"] for r in rows])
    assert rows[-1]["policy_version"] == steps
    # every step trained on data, those right after a restart included (a batch dropped whole is no step)
    assert all(r["train/num_trajectories"] > 0 for r in rows), (where, [r["train/num_trajectories"] for r in rows])
    restarts = _rows(tmp_path / "restarts.jsonl")
    for component in ("server0", "rollout", "trainer"):
        killed = [r for r in restarts if r["component"] == component and r["counted"]
                  and r["cause"] == "killed by SIGKILL"]
        assert len(killed) == 2, (where, restarts)
    assert "server0 2" in out and "trainer 2" in out, out  # the summary's restarts line
    assert "Traceback" not in err, err[-3000:]  # stopping the old rollout side for a restarted trainer is quiet
    # ... its unfinished groups are cancelled before its queue client closes, not failed one by one
    assert "rollout task failed" not in err, err[-3000:]
    _check_server_port(tmp_path, kills, url)
    rollout_log = (tmp_path / "logs" / "rollout.log").read_text()
    assert "restarted and back in rotation at weight version" in rollout_log, (where, rollout_log[-3000:])
    assert "joining a run in progress at version" in rollout_log, (where, rollout_log[-3000:])
    assert (tmp_path / "logs" / "trainer.log").read_text().count("resumed from") == 2, where
    # nothing produced was lost (outbox, rejoin) and nothing trained twice (dedup, rollback on resume)
    ledger = audit([tmp_path])
    assert ledger.ok and ledger.rolled_back > 0, (where, ledger.lines())  # training undone, and redone
    audited = subprocess.run([sys.executable, "-m", "async_rl.launch.cli", "audit", str(tmp_path)], cwd=ROOT,
                             capture_output=True, text=True, timeout=60)
    assert audited.returncode == 0 and "lost=0 duplicated=0 lost_prompts=0 duplicated_prompts=0" in audited.stdout, \
        audited.stdout + audited.stderr


def test_component_that_keeps_crashing_exhausts_the_budget(tmp_path):
    proc = _start(tmp_path, "total_steps=40", "supervise.max_restarts=1")
    pid_file, steps = tmp_path / "logs" / "rollout.pid", lambda: len(_rows(tmp_path / "metrics.jsonl"))
    try:
        _wait_for(lambda: steps() >= 1, proc, why="a train step")
        first = int(pid_file.read_text())
        _kill(first)  # restarted: the budget allows one
        _wait_for(lambda: int(pid_file.read_text()) != first and (tmp_path / "restarts.jsonl").is_file(), proc,
                  why="the rollout process restarted")
        _kill(int(pid_file.read_text()))  # the budget is spent: the run fails, naming why
        out, err = _finish(proc, timeout=200)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 2, err[-3000:]
    # the error line (a killed process's multiprocessing resource tracker may warn after it)
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and errors[0].startswith("error: rollout: killed by SIGKILL"), err[-3000:]
    assert "restarted 1 times already, the most supervise.max_restarts=1 allows" in errors[0], errors[0]
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
    assert "Traceback" not in err, err[-3000:]
    assert not _rows(tmp_path / "restarts.jsonl")  # what stops while draining is not restarted
    deadline = time.monotonic() + 20
    while any(running(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(running(p) for p in pids)
    ckpt = latest_checkpoint(tmp_path / "checkpoints")
    # the trainer finished the step it was in, checkpointed it, and told the rollout side to stop
    rows = _rows(tmp_path / "metrics.jsonl")
    assert ckpt is not None and ckpt.name == f"step_{len(rows):06d}", (ckpt, len(rows))
    assert 2 <= len(rows) < 40
    assert f"newest checkpoint {ckpt}" in err
    assert "trainer finished at version" in (tmp_path / "logs" / "rollout.log").read_text()
