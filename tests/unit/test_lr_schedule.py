"""trainer.lr_schedule: each schedule's factor at hand-computed steps."""

import math

import pytest

from async_rl.trainer.lr_schedule import get_lr_schedule


@pytest.mark.parametrize("name,warmup,total,expected", [
    ("constant", 0, 10, [1, 1, 1, 1]),
    ("constant", 2, 10, [1 / 3, 2 / 3, 1, 1]),
    ("linear", 0, 4, [1, 0.75, 0.5, 0.25, 0, 0]),     # TRL's default: 1 - step / steps
    ("linear", 1, 3, [0.5, 1, 0.5, 0, 0]),
    ("cosine", 0, 4, [1, (1 + math.cos(math.pi / 4)) / 2, 0.5, (1 + math.cos(3 * math.pi / 4)) / 2, 0]),
    ("linear", 0, 0, [1, 1, 1]),                       # no span known: no decay
])
def test_factors(name, warmup, total, expected):
    schedule = get_lr_schedule(name)
    assert [schedule(step, warmup, total) for step in range(len(expected))] == pytest.approx(expected)


@pytest.mark.parametrize("name,warmup,hold,floor,expected", [
    ("linear", 0, 2, 0.0, [1, 1, 1, 0.5, 0, 0]),                 # held 2 steps, then 4 - 2 steps of decay
    ("linear", 0, 0, 0.2, [1, 0.8, 0.6, 0.4, 0.2, 0.2]),       # decays to the floor and stays there
    ("cosine", 1, 1, 0.1, [0.5, 1, 1, 0.55, 0.1]),              # warm-up, hold, then half a cosine to 0.1
])
def test_hold_and_floor(name, warmup, hold, floor, expected):
    schedule = get_lr_schedule(name)
    assert [schedule(s, warmup, 4, hold=hold, floor=floor) for s in range(len(expected))] == pytest.approx(expected)


def test_transformers_warmup_stable_decay_is_the_same_schedule():
    """vs_trl.py hands TRL our held and floored decays as transformers' warmup_stable_decay: the same factors."""
    from transformers.optimization import _get_wsd_scheduler_lambda

    ours = get_lr_schedule("cosine")
    theirs = [_get_wsd_scheduler_lambda(s, num_warmup_steps=0, num_stable_steps=6, num_decay_steps=8,
                                        warmup_type="linear", decay_type="cosine", min_lr_ratio=0.1, num_cycles=0.5)
              for s in range(14)]
    assert [ours(s, 0, 14, hold=6, floor=0.1) for s in range(14)] == pytest.approx(theirs)


def test_a_run_decays_over_its_total_steps_unless_told_otherwise():
    from async_rl.config import load_config
    from async_rl.trainer.backends import trainer_config

    assert trainer_config(load_config(None, ["total_steps=7"])).lr_decay_steps == 7
    assert trainer_config(load_config(None, ["total_steps=7", "trainer.lr_decay_steps=20"])).lr_decay_steps == 20
