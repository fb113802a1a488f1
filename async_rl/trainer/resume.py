"""A run's identity and where a resumed trainer continues: run_dir/run_id, the newest checkpoint of
this run, and what was consumed before it.

    queue.run_id = run_id(run_dir, resume)              # kept by a resumed run, new otherwise
    step, prompts = resume(cfg, trainer, run_dir, queue, ledger)
"""

from __future__ import annotations

import json
import logging
import uuid
from pathlib import Path

from async_rl.config import Config
from async_rl.trainer.checkpoint import complete_checkpoints
from async_rl.transport.queue import TrajectoryQueueServer
from async_rl.utils.ledger import Ledger, committed_state
from async_rl.utils.prompts import PromptSet

logger = logging.getLogger(__name__)


def read_run_id(run_dir: Path) -> str:
    path = run_dir / "run_id"
    return path.read_text().strip() if path.is_file() else ""


def run_checkpoint(run_dir: Path) -> Path | None:
    """The newest checkpoint of this run (one left in run_dir by an earlier run is not resumed from)."""
    this_run = read_run_id(run_dir)
    for _, d in reversed(complete_checkpoints(run_dir / "checkpoints")):  # not one a killed trainer left half-written
        if json.loads((d / "meta.json").read_text()).get("run_id", this_run) == this_run:
            return d
    return None


def run_id(run_dir: Path, resume: bool) -> str:
    """This run's identity (kept by a resumed run): producers' outboxes hold data of one run only."""
    path = run_dir / "run_id"
    if resume and path.is_file():
        return path.read_text().strip()
    new = uuid.uuid4().hex
    path.write_text(new)
    return new


def resume(cfg: Config, trainer, run_dir: Path, queue: TrajectoryQueueServer,
           ledger: Ledger) -> tuple[int, PromptSet]:
    """Restore the newest checkpoint (weights, optimizer, version, RNG), or go back to step 0 with
    the initial weights when there is none; return the step to continue at and the prompt positions
    consumed before it. Everything after that step is undone: its metrics rows are dropped, the
    ledger marks the resume (the audit's final history leaves those steps out), and the ids consumed
    then are not marked seen, so the rollout side's re-sent copies are trained again."""
    ckpt = run_checkpoint(run_dir)
    if ckpt is None:
        logger.warning("trainer.resume: no checkpoint under %s: starting again from step 0",
                       run_dir / "checkpoints")
        step = 0
    else:
        step = int(trainer.load_checkpoint(str(ckpt))["step"])
    path = run_dir / "metrics.jsonl"
    if path.is_file():
        keep = [line for line in path.read_text().splitlines() if line.strip() and json.loads(line)["step"] < step]
        path.write_text("".join(line + "\n" for line in keep))
    ids, prompts = committed_state(ledger.path, step)
    ledger.record("resumed", from_step=step)
    queue.mark_seen(ids)  # sent again by a producer: acknowledged, not trained twice
    logger.info("resumed from %s: step %d, policy version %d (%d trajectories consumed before it)",
                ckpt or "the initial weights", step, trainer.policy_version, len(ids))
    return step, PromptSet(above=prompts)
