"""A trainer killed while writing a checkpoint leaves `step_N.tmpPID` with an empty meta.json; the restarted
trainer resumes from the newest complete checkpoint instead of failing on it (make test's random-kill run
crash-looped that way: "Expecting value: line 1 column 1 (char 0)" on every restart)."""

import json

from async_rl.trainer.checkpoint import latest_checkpoint, prune_checkpoints
from async_rl.trainer.resume import run_checkpoint


def test_a_half_written_checkpoint_is_passed_over_on_resume(tmp_path):
    (tmp_path / "run_id").write_text("r1")
    done = tmp_path / "checkpoints" / "step_000002"
    done.mkdir(parents=True)
    (done / "meta.json").write_text(json.dumps({"step": 2, "run_id": "r1"}))
    half = tmp_path / "checkpoints" / "step_000003.tmp4242"
    half.mkdir()
    (half / "meta.json").write_text("")  # killed between creating the file and writing it
    assert run_checkpoint(tmp_path) == done
    assert latest_checkpoint(tmp_path / "checkpoints") == done
    assert prune_checkpoints(tmp_path / "checkpoints", keep=1) == [] and half.exists()
