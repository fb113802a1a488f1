"""Test-only: imported into a run through `agent.modules`, it makes the trainer's checkpoint load take
DELAY_S seconds longer (a SmolLM2 checkpoint takes seconds; the debug model's, milliseconds), so a rollout
side restarted beside a resuming trainer says HELLO while the trainer is still loading its state
(`tests/e2e/test_resume.py`). Never part of a real run."""

import time

from async_rl.trainer.backends.single import SingleTrainer

DELAY_S = 8.0
_load = SingleTrainer.load_checkpoint


def _slow_load(self, path):
    time.sleep(DELAY_S)
    return _load(self, path)


SingleTrainer.load_checkpoint = _slow_load
