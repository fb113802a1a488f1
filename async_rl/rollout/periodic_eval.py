"""Held-out accuracy every `rollout.eval_every` policy versions, off the trainer's critical path.

When the rollout side loads version v with v % eval_every == 0 it starts a greedy evaluation
through the generation servers as a background task, beside training rollouts, and
appends a row to run_dir/eval.jsonl:

    {"when": "periodic", "step": v, "policy_version": v, "timing/train_wall_s": ...,
     "eval/accuracy": ..., "eval/version_min": ..., "eval/version_max": ...}

`timing/train_wall_s` is the wall time since the rollout side began generating, so
time-to-accuracy is read off the rows. A newer version may arrive while an evaluation
runs; its tokens then carry that version, and version_min/max say so.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from pathlib import Path
from typing import Any

from async_rl.rollout.evaluate import Evaluation

logger = logging.getLogger(__name__)


def record_eval(run_dir: str | Path, row: dict[str, Any]) -> None:
    """Append one evaluation row to run_dir/eval.jsonl."""
    with (Path(run_dir) / "eval.jsonl").open("a") as fh:
        fh.write(json.dumps(row) + "\n")


class PeriodicEval:
    def __init__(self, every: int, run_dir: str | Path, evaluation: Evaluation):
        self.every = every
        self.run_dir = run_dir
        self.evaluation = evaluation
        self.started = time.perf_counter()
        self._running: asyncio.Task | None = None

    def due(self, version: int) -> bool:
        return self.every > 0 and version > 0 and version % self.every == 0

    def maybe_start(self, version: int) -> asyncio.Task | None:
        """Start an evaluation of `version` if one is due and none is running (they never pile up)."""
        if not self.due(version):
            return None
        if self._running is not None and not self._running.done():
            logger.info("eval of v%d skipped: the previous one is still running", version)
            return None
        self._running = asyncio.create_task(self._run(version, time.perf_counter() - self.started))
        return self._running

    async def _run(self, version: int, wall_s: float) -> None:
        stats = await self.evaluation.run()
        record_eval(self.run_dir, {"when": "periodic", "step": version, "policy_version": version,
                                   "timing/train_wall_s": wall_s, **stats})
        logger.info("eval v%d: accuracy %.3f (train wall %.0fs)", version, stats["eval/accuracy"], wall_s)

    async def close(self) -> None:
        if self._running is not None and not self._running.done():
            self._running.cancel()
            await asyncio.gather(self._running, return_exceptions=True)
