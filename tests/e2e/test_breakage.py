"""Each guarantee broken on purpose in a real run, and the check that guards it seen to fail.

Real-run tests elsewhere assert that the audit (`async-rl audit`) and the staleness checks
(`admission.py`) pass; these show they can fail. Each breaks one guarantee in a run of the debug
config, from outside the code: a test-only module imported through `agent.modules` (the rollout
side and the trainer import it), or a peer of the test's own on the run's queue:

- a reward function that returns NaN for some samples (`nan_reward.py`): the run finishes its
  steps, each refused group is logged naming the reward function and the sample, and the audit
  counts the refused samples as lost (before, the trainer dropped such a group without a word
  and its producer's credits stayed held: the run hung);
- the outbox re-send disabled (`no_resend.py`) and the trainer killed mid-run: the groups it had
  trained and not committed are never sent again; the audit finds them lost (before, their
  prompts generated again made them "replaced");
- a peer that says the rollout side's name and feeds the trainer a group nobody produced: the
  audit finds it invented (before, nothing checked that what was trained had been produced);
- the staleness gate loosened (`no_staleness_gate.py`): the end-to-end staleness checks fail.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest
import zmq

from async_rl.transport.codec import decode, encode
from async_rl.transport.messages import PROTOCOL_VERSION
from async_rl.types import Trajectory
from tests.e2e.admission import GATE_OFF_MODULE, check_admission
from tests.e2e.clitools import DEBUG, cli, running
from tests.e2e.test_supervision import _finish, _pid, _rows, _start, _wait_for

QUICK = ["log.progress=false", "task.eval_size=3", "trainer.batch_size=32"]


def _audit(run_dir: Path) -> tuple[int, str]:
    res = cli("audit", str(run_dir), timeout=60)
    return res.returncode, res.stdout + res.stderr


def test_bad_rewards_and_refused_requests_end_their_groups_and_the_run_finishes_counting_them(tmp_path):
    """One run, two broken kinds of sample (agents cycled per prompt, `task.agents`): a reward function that
    returns NaN for some (`nan_reward.py`: the run used to hang, its producer's credits held), and prompts
    longer than the model's context for others (`refused_request.py`: the server answers 400, as SGLang and
    vLLM also do inside an HTTP 200 stream; it used to stop the rollout side). Each is one refused group,
    said once in the log; the run finishes its steps; the audit fails, counting the NaN groups as lost
    with their reason and the refused requests' prompts as never trained."""
    steps = 4
    res = cli("run", "--config", DEBUG, f"run_dir={tmp_path}", f"total_steps={steps}", *QUICK,
              "agent.modules=[tests.e2e.nan_reward,tests.e2e.refused_request]",
              "task.agents=[nan_reward,too_long]", timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert not (tmp_path / "restarts.jsonl").exists(), res.stderr[-3000:]
    assert [r["step"] for r in _rows(tmp_path / "metrics.jsonl")] == list(range(steps))
    log = (tmp_path / "logs" / "rollout.log").read_text().splitlines()
    nan = [line for line in log if "refused a group, not sent to the trainer: a non-finite score" in line]
    assert nan and all("reward function ArithTask.reward" in line and "sample train-" in line for line in nan)
    too_long = [line for line in log if "a generation server refused a request of the group" in line]
    assert too_long and all("request refused" in line for line in too_long), too_long[:3]
    code, out = _audit(tmp_path)
    refused = int(out.split("refused=")[1].split()[0])
    lost_prompts = int(out.split("lost_prompts=")[1].split()[0])
    assert code == 1 and refused > 0 and refused % 8 == 0, out  # whole NaN groups (the refused requests had none)
    assert f"lost={refused} " in out and "refused " + str(refused) + ": a non-finite score" in out, out
    assert lost_prompts >= len(too_long), out  # the refused requests' prompts, never trained
    assert "a non-finite score from agent loop 'nan_reward'" in res.stdout  # the run says so


def test_with_the_outbox_resend_broken_a_trainer_restart_loses_what_the_audit_then_finds(tmp_path):
    """No checkpoint before the end (trainer.checkpoint_budget=0): the trainer killed after two steps
    resumes from step 0, and every group it had trained must come again from the rollout side's outbox."""
    steps = 6
    proc = _start(tmp_path, f"total_steps={steps}", *QUICK, "trainer.checkpoint_budget=0",
                  "agent.modules=[tests.e2e.no_resend]")
    try:
        _wait_for(lambda: len(_rows(tmp_path / "metrics.jsonl")) >= 2, proc, why="two steps")
        pid = _pid(tmp_path, "trainer")
        os.kill(pid, signal.SIGKILL)
        _wait_for(lambda: not running(pid), proc, why="the trainer gone")
        out, err = _finish(proc, timeout=400)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, err[-3000:]
    assert "resumed from the initial weights: step 0" in (tmp_path / "logs" / "trainer.log").read_text()
    code, out = _audit(tmp_path)
    lost = int(out.split("lost=")[1].split()[0])
    rolled_back = int(out.split("rolled_back=")[1].split()[0])
    assert code == 1 and lost > 0 and rolled_back > 0, out  # the old audit called them replaced: clean


def _invented_group(n: int) -> list[Trajectory]:
    """Trajectories of no prompt of the stream (one that named a prompt would also trip the prompt count)."""
    r = 1
    return [Trajectory(id=f"invented-{j}", group_id="invented", prompt_ids=np.array([3, 4, 5, 6], np.int32),  # [P]
                       response_ids=np.array([4], np.int32), loss_mask=np.ones(r, np.uint8),  # [R]
                       behav_logprobs=np.full(r, -1.0, np.float32), versions=np.zeros(r, np.int32),
                       reward=1.0, finish_reason="stop") for j in range(n)]


def _inject(run_dir: Path, name: str) -> None:
    """A peer of the test's own says HELLO as `name` (the rollout side's name, on a socket of its own) and,
    once it has credits, sends a group nobody produced."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 2000)
    sock.setsockopt(zmq.IDENTITY, b"an-impostor")
    sock.connect((run_dir / "trainer_address").read_text())
    try:
        sock.send_multipart([b"HELLO", encode({"producer_id": name, "protocol": PROTOCOL_VERSION, "session": 1})])
        granted, deadline = 0, time.monotonic() + 120
        while granted < 8:
            assert time.monotonic() < deadline, "no credits for the impostor"
            sock.send_multipart([b"HB", encode({"want": 8})])
            if sock.poll(500):
                kind, payload = sock.recv_multipart()
                if kind in (b"CREDIT", b"HB"):
                    granted = decode(payload).get("granted", 0)
        trajs = _invented_group(8)
        sock.send_multipart([b"GROUP", encode({"seq": 1, "trajectories": [t.to_wire() for t in trajs]})])
        sock.send_multipart([b"BYE", encode({"reason": "done"})])
    finally:
        sock.close()


def test_a_peer_that_takes_the_rollout_sides_name_is_found_by_the_audit(tmp_path):
    steps = 5
    proc = _start(tmp_path, f"total_steps={steps}", *QUICK)
    try:
        _wait_for(lambda: len(_rows(tmp_path / "metrics.jsonl")) >= 1, proc, why="a step")
        side = json.loads((tmp_path / "ledger_rollout.jsonl").read_text().splitlines()[0])
        _inject(tmp_path, side["producer"])
        out, err = _finish(proc, timeout=400)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, err[-3000:]
    code, out = _audit(tmp_path)
    assert code == 1 and "invented=8 " in out and "invented ids (first 10): invented-" in out, out


@pytest.mark.parametrize("eta", [1])
def test_with_the_staleness_gate_off_the_staleness_checks_fail(tmp_path, eta):
    steps = 4
    res = cli("run", "--config", DEBUG, f"run_dir={tmp_path}", f"max_staleness={eta}", f"total_steps={steps}",
              *QUICK, "transport.capacity=1024", f"agent.modules=[{GATE_OFF_MODULE}]", timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    train = _rows(tmp_path / "metrics.jsonl")
    rollout = _rows(tmp_path / "rollout_metrics.jsonl")
    with pytest.raises(AssertionError, match="the staleness gate admits"):
        check_admission(train, rollout, eta=eta, batch=32)
