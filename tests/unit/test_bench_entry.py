"""`make bench`'s comparison (benchmarks/async_vs_sync.py): frozen unless asked to learn, and its short
table's ratios taken against the sync run of the same round and set-up."""

import pytest

from benchmarks.async_vs_sync import headline, policy_overrides


def test_the_policy_is_frozen_unless_learning_is_asked_for():
    assert policy_overrides(False, ["seed=1"]) == ["trainer.lr=0", "seed=1"]
    assert policy_overrides(True, ["trainer.lr=1e-5"]) == ["trainer.lr=1e-5"]
    assert policy_overrides(False, ["trainer.lr=0"]) == ["trainer.lr=0", "trainer.lr=0"]
    with pytest.raises(SystemExit, match="trainer.lr=1e-5: .*pass --learn"):
        policy_overrides(False, ["trainer.lr=1e-5"])


def _run(setting: str, rnd: int, traj_s: float) -> dict:
    return {"setup": "pools", "setting": setting, "round": rnd, "run_trained_traj_per_s": traj_s,
            "run_trained_tokens_per_s": 10 * traj_s, "trainer_idle_frac": 0.5, "dropped_stale": 0}


def test_the_short_table_takes_each_ratio_within_its_round():
    # round 0's machine ran twice as fast as round 1's: the ratios must not mix the rounds
    runs = [_run("sync", 0, 20.0), _run("async eta=2", 0, 40.0), _run("sync", 1, 10.0), _run("async eta=2", 1, 15.0)]
    rows = headline(runs).splitlines()
    assert rows[3].startswith("| pools | async eta=2 | 2 | 27.5 | 1.75x (1.50-2.00) |")
