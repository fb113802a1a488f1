"""rollout.truncated_reward on the real rollout controller and a real server (the debug config's tiny
model, every response forced to its length limit; set-up of test_restart_stale.py)."""

import pytest

from tests.integration.test_restart_stale import _run, setup  # noqa: F401  (setup: the fixture)


@pytest.mark.parametrize("truncated", [None, -1.0])
def test_a_response_cut_at_the_length_limit_gets_the_truncated_reward(setup, truncated):  # noqa: F811
    """Applied by the controller to what any agent loop returns: every response here is cut, so each is
    paid -1 and keeps its score in info["score"]; unset, each keeps its score (0 or 1)."""
    _, pushed = _run(setup, restart=True, updates=0, truncated_reward=truncated)
    trajs = [t for _, group in pushed for t in group]
    assert trajs and all(t.finish_reason == "length" for t in trajs)
    if truncated is None:
        assert all(t.reward in (0.0, 1.0) and "score" not in t.info for t in trajs)
    else:
        assert all(t.reward == truncated and t.info["score"] in (0.0, 1.0) for t in trajs)
