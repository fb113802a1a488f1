"""The trajectory ledger's audit: lost and duplicated ids are found, accounted ones are not."""

import json

import pytest

from async_rl.utils.ledger import Ledger, audit, roll_back
from launch.cli import main


def _write(tmp_path, rollout, trainer):
    for name, events in (("ledger_rollout.jsonl", rollout), ("ledger_trainer.jsonl", trainer)):
        led = Ledger(tmp_path / name)
        for event, ids, extra in events:
            led.record(event, ids, **extra)
        led.close()


def test_a_clean_run_audits_clean_and_the_command_exits_0(tmp_path, capsys):
    _write(tmp_path, [("produced", ["a", "b"], {}), ("produced", ["c", "d"], {}), ("untrained_at_end", ["d"], {})],
           [("trained", ["a", "b"], {"step": 0}), ("dropped_stale", ["c"], {"step": 1})])
    result = audit([tmp_path])
    assert result.ok and (result.produced, result.trained, result.dropped_stale, result.untrained_at_end) == (4, 2, 1, 1)
    assert main(["audit", str(tmp_path)]) == 0
    assert "lost=0 duplicated=0" in capsys.readouterr().out


def test_lost_and_duplicated_ids_are_found_and_the_command_exits_1(tmp_path, capsys):
    _write(tmp_path, [("produced", ["a", "b", "c"], {})],
           [("trained", ["a"], {"step": 0}), ("trained", ["a"], {"step": 1})])
    result = audit([tmp_path])
    assert result.lost_ids == ["b", "c"] and result.duplicated_ids == ["a"]
    assert main(["audit", str(tmp_path)]) == 1
    assert "lost=2 duplicated=1" in capsys.readouterr().out


def test_training_rolled_back_by_a_resume_is_not_a_duplicate(tmp_path):
    _write(tmp_path, [("produced", ["a", "b"], {})],
           [("trained", ["a"], {"step": 0}), ("trained", ["b"], {"step": 1})])
    assert roll_back(tmp_path / "ledger_trainer.jsonl", from_step=1) == 1
    led = Ledger(tmp_path / "ledger_trainer.jsonl")
    led.record("trained", ["b"], step=1)  # trained again after the resume: once, not twice
    led.close()
    result = audit([tmp_path])
    assert result.ok and result.trained == 2


def test_a_line_cut_by_a_kill_is_skipped_and_no_ledger_is_a_clear_error(tmp_path):
    _write(tmp_path, [("produced", ["a"], {})], [("trained", ["a"], {"step": 0})])
    with (tmp_path / "ledger_trainer.jsonl").open("a") as f:
        f.write(json.dumps({"event": "trained", "ids": ["x"]})[:12])
    assert audit([tmp_path]).ok
    with pytest.raises(ValueError, match="no ledger"):
        audit([tmp_path / "nowhere"])
