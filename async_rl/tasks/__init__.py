"""Tasks: where prompts come from and how responses are scored. Chosen by `task.name`."""

from __future__ import annotations

from async_rl.config import TaskConfig
from async_rl.tasks.arith import ArithTask

TASKS = {"arith": ArithTask}


def build_task(cfg: TaskConfig):
    if cfg.name not in TASKS:
        raise ValueError(f"task.name: unknown task {cfg.name!r}; allowed: {', '.join(sorted(TASKS))}")
    return TASKS[cfg.name](cfg)
