"""The rollout side's durable outbox: groups survive a restart until acknowledged, and belong to one run."""

import os
import subprocess
import sys

import numpy as np
import pytest

from async_rl.transport.outbox import Outbox, SideTakenError, claim_side
from async_rl.types import Trajectory, new_id


def _group(n=2):
    gid = new_id()
    return [Trajectory(id=new_id(), group_id=gid, prompt_ids=np.arange(3, dtype=np.int32),
                       response_ids=np.arange(2, dtype=np.int32), loss_mask=np.ones(2, dtype=np.uint8),
                       behav_logprobs=np.full(2, -0.5, dtype=np.float32), versions=np.zeros(2, dtype=np.int32),
                       reward=1.0, finish_reason="stop") for _ in range(n)]


def test_unacknowledged_groups_come_back_after_a_restart(tmp_path):
    box = Outbox(tmp_path / "outbox", "run-a")
    a, b, c = _group(), _group(), _group()
    for g in (a, b, c):
        box.put(g)
    box.ack([t.id for t in a])  # the trainer consumed a
    box.ack([b[0].id])  # half of b
    again = Outbox(tmp_path / "outbox", "run-a").pending()  # a new process, same run
    assert [[t.id for t in g] for g in again] == [[t.id for t in b], [t.id for t in c]]
    assert np.array_equal(again[0][0].behav_logprobs, b[0].behav_logprobs)


def test_another_runs_outbox_is_discarded_and_a_cut_file_is_dropped(tmp_path):
    box = Outbox(tmp_path / "outbox", "run-a")
    box.put(_group())
    assert Outbox(tmp_path / "outbox", "run-b").pending() == []  # never sent to the wrong trainer
    box = Outbox(tmp_path / "outbox", "run-b")
    box.put(_group())
    (tmp_path / "outbox" / "cut.grp").write_bytes(b"\x93\x01")
    assert len(Outbox(tmp_path / "outbox", "run-b").pending()) == 1
    assert not (tmp_path / "outbox" / "cut.grp").exists()


_CLAIM = "import sys, time; from async_rl.transport.outbox import claim_side; print(claim_side(sys.argv[1]), flush=True); time.sleep(60)"


def test_a_side_keeps_its_id_across_restarts_and_a_second_live_side_is_refused(tmp_path):
    first = subprocess.Popen([sys.executable, "-c", _CLAIM, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        side = first.stdout.readline().strip()
        with pytest.raises(SideTakenError, match=rf"another rollout side \(pid {first.pid}\) uses it"):
            claim_side(tmp_path)
    finally:
        first.kill()  # SIGKILL: the lock goes with the process
        first.wait()
    assert claim_side(tmp_path) == side  # the restarted side says HELLO under the same producer id
    other = tmp_path / "other"
    again = subprocess.run([sys.executable, "-c", _CLAIM.replace("time.sleep(60)", "pass"), str(other)],
                           capture_output=True, text=True, timeout=60, env={**os.environ})
    assert again.returncode == 0 and again.stdout.strip() not in ("", side)  # another directory, another side
