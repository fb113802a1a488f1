"""The trajectory ledger's audit judges the final history: each guarantee broken on purpose is found.

Events are written as the sides write them (rollout: side, produced with its prompt, refused, discarded,
untrained_at_end, abandoned_groups; trainer: session, received, refused, trained/dropped_* with step and
prompts, resumed, held_at_end), then `audit` and `async-rl audit` must name what is wrong.
"""

import json

import pytest

from async_rl.utils.ledger import Ledger, audit, committed_state
from async_rl.launch.cli import main

SIDE = [("side", [], {"producer": "P"})]
SESSION = [("session", [], {"producer": "P"})]


def _write(tmp_path, rollout, trainer, sub=""):
    d = tmp_path / sub if sub else tmp_path
    for name, events in (("ledger_rollout.jsonl", rollout), ("ledger_trainer.jsonl", trainer)):
        if events is None:
            continue
        led = Ledger(d / name)
        for event, ids, extra in events:
            led.record(event, ids, **extra)
        led.close()
    return d


def _produced(ids, prompt):
    return ("produced", ids, {"prompt": prompt})


def _trained(ids, prompt, step):
    return ("trained", ids, {"prompts": [prompt] * len(ids), "step": step})


def _received(ids, prompt, who="P"):
    return ("received", ids, {"prompts": [prompt] * len(ids), "identity": who})


def test_a_clean_run_audits_clean_and_the_command_exits_0(tmp_path, capsys):
    _write(tmp_path, [*SIDE, _produced(["a", "b"], 0), _produced(["c"], 1), _produced(["d"], 2),
                      ("untrained_at_end", ["d"], {})],
           [*SESSION, _received(["a", "b"], 0), _trained(["a", "b"], 0, 0), _received(["c"], 1),
            ("dropped_stale", ["c"], {"prompts": [1], "step": 1})])
    result = audit([tmp_path])
    assert result.ok, result.lines()
    assert (result.produced, result.trained, result.dropped_stale, result.untrained_at_end) == (4, 2, 1, 1)
    assert main(["audit", str(tmp_path)]) == 0
    assert "lost=0 duplicated=0 lost_prompts=0 duplicated_prompts=0" in capsys.readouterr().out


def test_lost_and_duplicated_ids_are_found_and_the_command_exits_1(tmp_path, capsys):
    _write(tmp_path, [*SIDE, _produced(["a", "b", "c"], 0)], [*SESSION, _trained(["a"], 0, 0), _trained(["a"], 0, 1)])
    result = audit([tmp_path])
    assert result.lost_ids == ["b", "c"] and result.duplicated_ids == ["a"]
    assert main(["audit", str(tmp_path)]) == 1
    assert "lost=2 duplicated=1" in capsys.readouterr().out


def test_training_undone_by_a_resume_and_redone_counts_once(tmp_path):
    _write(tmp_path, [*SIDE, _produced(["a"], 0), _produced(["b"], 1)],
           [*SESSION, _trained(["a"], 0, 0), _trained(["b"], 1, 1), ("resumed", [], {"from_step": 1}),
            _trained(["b"], 1, 1)])
    result = audit([tmp_path])
    assert result.ok and result.trained == 2 and result.rolled_back == 1


def test_training_undone_by_a_resume_and_never_redone_is_lost(tmp_path):
    """A re-send skipped on purpose: the old audit counted rolled-back ids as accounted."""
    _write(tmp_path, [*SIDE, _produced(["a"], 0), _produced(["b"], 1)],
           [*SESSION, _trained(["a"], 0, 0), _trained(["b"], 1, 1), ("resumed", [], {"from_step": 1})])
    result = audit([tmp_path])
    assert result.lost_ids == ["b"] and result.lost_prompts == [1] and not result.ok


def test_two_resumes_from_one_checkpoint_cannot_hide_a_duplicate(tmp_path):
    """The old roll_back subtracted x twice (once per resume), so x trained twice after them read as once."""
    _write(tmp_path, [*SIDE, _produced(["x"], 0)],
           [*SESSION, _trained(["x"], 0, 3), ("resumed", [], {"from_step": 2}), ("resumed", [], {"from_step": 2}),
            _trained(["x"], 0, 2), _trained(["x"], 0, 3)])
    result = audit([tmp_path])
    assert result.duplicated_ids == ["x"] and not result.ok


def test_a_dead_sides_undelivered_groups_are_replaced_when_their_prompts_are_generated_again(tmp_path):
    dead = _write(tmp_path, [("side", [], {"producer": "A"}), _produced(["a1"], 0), _produced(["a2"], 1)], None, "a")
    trainer = [("session", [], {"producer": "A"}), ("session", [], {"producer": "B"}), _trained(["a1"], 0, 0)]
    t = _write(tmp_path, None, trainer, "t")
    b = _write(tmp_path, [("side", [], {"producer": "B"}), _produced(["b1"], 1)], None, "b")
    before = audit([t, dead, b])  # prompt 1 not consumed yet: both groups of it are lost, and the prompt
    assert before.lost_ids == ["a2", "b1"] and before.lost_prompts == [1]
    Ledger(t / "ledger_trainer.jsonl").record("trained", ["b1"], prompts=[1], step=1)
    result = audit([t, dead, b])
    assert result.ok and result.replaced == 1, result.lines()


def test_a_side_the_trainer_heard_without_its_ledger_makes_the_audit_incomplete(tmp_path, capsys):
    t = _write(tmp_path, None, [*SESSION, _trained(["a"], 0, 0)], "t")
    result = audit([t])
    assert result.missing_sides == ["P"] and not result.ok
    assert main(["audit", str(t)]) == 1
    assert "incomplete: no rollout ledger for side(s) P" in capsys.readouterr().out


def test_a_prompt_trained_through_two_groups_and_a_skipped_prompt_are_found(tmp_path):
    _write(tmp_path, [*SIDE, _produced(["a"], 0), _produced(["b"], 0), _produced(["c"], 2)],
           [*SESSION, _trained(["a"], 0, 0), _trained(["b"], 0, 1), _trained(["c"], 2, 2)])
    result = audit([tmp_path])
    assert result.duplicated_prompts == [0] and result.lost_prompts == [1] and not result.ok


def test_prompts_abandoned_at_the_end_and_discarded_groups_are_accounted(tmp_path):
    _write(tmp_path, [*SIDE, _produced(["a"], 0), _produced(["x"], 1),
                      ("discarded", ["x"], {"prompt": 1, "reason": "newer than the trainer"}), _produced(["y"], 1),
                      ("abandoned_groups", [], {"count": 1, "prompts": [2]}), _produced(["c"], 3),
                      ("untrained_at_end", ["c"], {})],
           [*SESSION, _trained(["a"], 0, 0), _trained(["y"], 1, 1)])
    result = audit([tmp_path])
    assert result.ok and result.discarded == 1, result.lines()


def test_committed_state_is_what_a_resume_at_that_step_keeps(tmp_path):
    _write(tmp_path, None, [_trained(["a"], 0, 0), ("dropped_stale", ["s"], {"prompts": [1], "step": 1}),
                            _trained(["b"], 2, 2), ("resumed", [], {"from_step": 1}), _trained(["c"], 3, 1)])
    assert committed_state(tmp_path / "ledger_trainer.jsonl", 2) == (["a", "c"], [0, 3])
    assert committed_state(tmp_path / "ledger_trainer.jsonl", 0) == ([], [])


def test_a_line_cut_by_a_kill_is_skipped_and_no_ledger_is_a_clear_error(tmp_path):
    _write(tmp_path, [*SIDE, _produced(["a"], 0)], [*SESSION, _trained(["a"], 0, 0)])
    with (tmp_path / "ledger_trainer.jsonl").open("a") as f:
        f.write(json.dumps({"event": "trained", "ids": ["x"]})[:12])
    assert audit([tmp_path]).ok
    with pytest.raises(ValueError, match="no ledger"):
        audit([tmp_path / "nowhere"])


def test_filtered_groups_are_accounted_and_use_up_their_prompt(tmp_path):
    # prompt 0 had no reward variance: filtered while step 0's batch was filled; prompt 1 was trained
    filtered = ("filtered", ["a", "b"], {"prompts": [0, 0], "step": 0})
    _write(tmp_path, [*SIDE, _produced(["a", "b"], 0), _produced(["c", "d"], 1)],
           [*SESSION, filtered, _trained(["c", "d"], 1, 0)])
    result = audit([tmp_path])
    assert result.ok, result.lines()
    assert result.filtered == 2 and result.trained == 2
    assert "filtered=2" in result.lines()[0]
    assert committed_state(tmp_path / "ledger_trainer.jsonl", 1) == (["a", "b", "c", "d"], [0, 1])
    # a resume back to step 0 undoes the filtering too: unless the group comes back, it is lost
    _write(tmp_path, None, [("resumed", [], {"from_step": 0})])
    assert audit([tmp_path]).lost_ids == ["a", "b", "c", "d"]


# --------------------------------------------------------------------------- what the audit's words mean
def test_delivered_and_never_trained_is_lost_though_reported_untrained_at_end(tmp_path):
    """The hole a non-finite reward fell through: the trainer took the group in and never trained it; the
    rollout side reported it untrained at the end. Only what the trainer held when it ended is untrained."""
    rollout = [*SIDE, _produced(["a"], 0), _produced(["b"], 1), _produced(["c"], 2),
               ("untrained_at_end", ["b", "c"], {})]
    trainer = [*SESSION, _received(["a"], 0), _trained(["a"], 0, 0), _received(["b"], 1), _received(["c"], 2),
               ("held_at_end", ["c"], {})]
    _write(tmp_path, rollout, trainer)
    result = audit([tmp_path])
    assert result.lost_ids == ["b"] and result.lost_prompts == [1] and result.untrained_at_end == 1, result.lines()


def test_what_a_trainer_held_before_it_restarted_is_not_held_at_the_end(tmp_path):
    _write(tmp_path, [*SIDE, _produced(["a"], 0), ("untrained_at_end", ["a"], {})],
           [*SESSION, _received(["a"], 0), ("held_at_end", ["a"], {}), ("resumed", [], {"from_step": 0})])
    assert audit([tmp_path]).lost_ids == ["a"]


def test_never_sent_is_untrained_only_while_nothing_after_it_was_sent(tmp_path):
    """A side sends in order: an older group left in its outbox while newer ones went out was never re-sent."""
    rollout = [*SIDE, _produced(["a"], 0), _produced(["b"], 1), _produced(["c"], 2), _produced(["d"], 3),
               ("untrained_at_end", ["b", "d"], {})]
    trainer = [*SESSION, _received(["a"], 0), _trained(["a"], 0, 0), _received(["c"], 2), _trained(["c"], 2, 1)]
    _write(tmp_path, rollout, trainer)
    result = audit([tmp_path])
    assert result.lost_ids == ["b"] and result.untrained_at_end == 1, result.lines()  # d was last in line: fine


def test_training_rolled_back_and_never_resent_is_lost_though_the_prompt_came_again(tmp_path):
    """Issue 41's case 2: trained at step 1, resumed from step 1, never re-sent, the prompt generated again:
    the old audit called it replaced (rolled_back=1 lost=0). Replaced means never delivered."""
    rollout = [*SIDE, _produced(["a"], 0), _produced(["b"], 1), _produced(["b2"], 1)]
    trainer = [*SESSION, _received(["a"], 0), _trained(["a"], 0, 0), _received(["b"], 1), _trained(["b"], 1, 1),
               ("resumed", [], {"from_step": 1}), _received(["b2"], 1), _trained(["b2"], 1, 1)]
    _write(tmp_path, rollout, trainer)
    result = audit([tmp_path])
    assert result.lost_ids == ["b"] and result.replaced == 0 and result.rolled_back == 1, result.lines()


def test_trained_but_produced_by_no_side_or_by_another_is_invented(tmp_path):
    """A peer that took the side's name: what it fed the trainer was never produced (or not by it)."""
    rollout = [*SIDE, _produced(["a"], 0), _produced(["b"], 1)]
    trainer = [*SESSION, ("session", [], {"producer": "P", "identity": "K-thief"}), _received(["a"], 0),
               _received(["x"], 1, who="P"), _received(["b"], 1, who="K-thief"), _trained(["a", "x", "b"], 0, 0)]
    t = _write(tmp_path, None, trainer, "t")
    r = _write(tmp_path, rollout, None, "r")
    result = audit([t, r])
    assert result.invented_ids == ["b", "x"] and result.missing_sides == ["K-thief"] and not result.ok
    # the same run with only the side's own deliveries is clean
    _write(tmp_path, None, [*SESSION, _received(["a"], 0), _received(["b"], 1), _trained(["a", "b"], 0, 0)], "t2")
    assert audit([tmp_path / "t2", r]).ok


def test_refused_groups_are_lost_unless_their_prompt_was_trained_through_another(tmp_path, capsys):
    nan = "malformed: GROUP.trajectories[0]: Trajectory.reward: must be finite, got nan"
    rollout = [*SIDE, _produced(["a"], 0), _produced(["b"], 1), ("refused", ["b"], {"prompt": 1, "reason": "nan reward"}),
               _produced(["c"], 2), _produced(["c2"], 2), ("untrained_at_end", ["c"], {})]
    trainer = [*SESSION, _received(["a"], 0), _trained(["a"], 0, 0),
               ("refused", ["c"], {"prompts": [2], "reason": nan, "identity": "P"}), _received(["c2"], 2),
               _trained(["c2"], 2, 1)]
    _write(tmp_path, rollout, trainer)
    result = audit([tmp_path])
    assert result.refused == 2 and result.lost_ids == ["b"] and result.lost_prompts == [1], result.lines()
    assert result.refusals == {"nan reward": 1, nan: 1}
    assert main(["audit", str(tmp_path)]) == 1
    assert f"refused 1: {nan}" in capsys.readouterr().out
