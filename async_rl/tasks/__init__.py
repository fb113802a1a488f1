"""Tasks: where prompts come from and how responses are scored. Chosen by `task.name`."""

from __future__ import annotations

from async_rl.config import TaskConfig
from async_rl.tasks.arith import ArithTask
from async_rl.tasks.interaction_debug import InteractionDebugTask
from async_rl.tasks.tir_arith import TirArithTask

TASKS = {"arith": ArithTask, "tir_arith": TirArithTask, "interaction_debug": InteractionDebugTask}


def build_task(cfg: TaskConfig):
    if cfg.name not in TASKS:
        raise ValueError(f"task.name: unknown task {cfg.name!r}; allowed: {', '.join(sorted(TASKS))}")
    return TASKS[cfg.name](cfg)
