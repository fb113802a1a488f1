"""Restart budgets (async_rl/launch/supervision.py): per component, shared through restarts.jsonl, with backoff;
the trainer's drain flag set by SIGTERM (async_rl/trainer/drain.py)."""

import os
import signal

import pytest

from async_rl.config import ConfigError, load_config
from async_rl.launch.supervision import RestartBudget, read_restarts, restart_lines
from async_rl.trainer.drain import Drain, DrainRequested


def _cfg(tmp_path, *overrides):
    return load_config(None, [f"run_dir={tmp_path}", *overrides])


def test_budget_per_component_with_doubling_backoff(tmp_path):
    budget = RestartBudget(_cfg(tmp_path, "supervise.max_restarts=3", "supervise.restart_backoff_s=1.5"))
    delays = []
    while budget.allow("server0"):
        delays.append(budget.record("server0", "killed by SIGKILL"))
    assert delays == [1.5, 3.0, 6.0]
    assert budget.allow("trainer")  # another component has its own budget
    assert "restarted 3 times already, the most supervise.max_restarts=3 allows" in budget.spent("server0", "x")
    rows = read_restarts(tmp_path)
    assert [(r["component"], r["restart"], r["cause"]) for r in rows] == [("server0", n, "killed by SIGKILL")
                                                                         for n in (1, 2, 3)]
    assert restart_lines(tmp_path) == [f"restarts: server0 3 (causes in {tmp_path / 'restarts.jsonl'})"]
    budget.record("rollout", "the trainer restarts", counted=False)  # forced: no budget spent, named as such
    assert budget.allow("rollout") and budget.used["rollout"] == 0
    assert restart_lines(tmp_path)[0].startswith("restarts: rollout 1 (1 following another's restart), server0 3 (")


def test_backoff_is_capped_and_a_forced_restart_is_free(tmp_path):
    budget = RestartBudget(_cfg(tmp_path, "supervise.max_restarts=10", "supervise.restart_backoff_s=20"))
    assert [budget.record("rollout", "x") for _ in range(3)] == [20.0, 40.0, 60.0]
    assert budget.record("rollout", "the trainer restarts", counted=False) == 0.0
    assert budget.used["rollout"] == 3


def test_a_new_process_counts_the_restarts_already_recorded(tmp_path):
    """The rollout process that restarts its servers is itself restartable: the budget survives it."""
    cfg = _cfg(tmp_path, "supervise.max_restarts=2")
    first = RestartBudget(cfg)
    first.record("server0", "killed by SIGKILL")
    first.record("rollout", "forced", counted=False)
    second = RestartBudget(cfg)
    assert second.used["server0"] == 1 and second.used["rollout"] == 0
    second.record("server0", "killed by SIGKILL")
    assert not RestartBudget(cfg).allow("server0")


def test_zero_restarts_is_todays_behaviour(tmp_path):
    budget = RestartBudget(_cfg(tmp_path, "supervise.max_restarts=0"))
    assert not budget.allow("trainer")
    assert budget.spent("trainer", "trainer: boom") == "trainer: boom"


@pytest.mark.parametrize("override", ["supervise.max_restarts=-1", "supervise.restart_backoff_s=-1",
                                      "supervise.drain_timeout_s=0"])
def test_bad_supervise_values_name_the_key(tmp_path, override):
    with pytest.raises(ConfigError, match=override.split("=")[0].replace(".", r"\.")):
        _cfg(tmp_path, override)


def test_sigterm_sets_the_drain_flag_instead_of_interrupting():
    previous = signal.getsignal(signal.SIGTERM)
    try:
        drain = Drain.install()
        drain.check()  # nothing requested: returns
        os.kill(os.getpid(), signal.SIGTERM)
        assert drain.requested
        with pytest.raises(DrainRequested):
            drain.check()
    finally:
        signal.signal(signal.SIGTERM, previous)
