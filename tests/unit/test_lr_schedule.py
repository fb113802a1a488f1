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


def test_a_run_decays_over_its_total_steps_unless_told_otherwise():
    from async_rl.config import load_config
    from async_rl.trainer.backends import trainer_config

    assert trainer_config(load_config(None, ["total_steps=7"])).lr_decay_steps == 7
    assert trainer_config(load_config(None, ["total_steps=7", "trainer.lr_decay_steps=20"])).lr_decay_steps == 20
