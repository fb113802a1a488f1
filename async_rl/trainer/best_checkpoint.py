"""The run's best checkpoint: the version with the best held-out accuracy the run saw, kept as run_dir/best.

    keeper = BestKeeper(cfg)
    keeper.after_publish(trainer)   # each step, once its version is out
    keeper.finish(trainer)          # after the rollout side's final evaluation

The rollout side scores every `rollout.eval_every`-th version beside training (eval.jsonl, "periodic")
and the final one after it ("after"). When the trainer publishes a version it cannot know whether it
will score best, and by the time its evaluation reports the trainer has moved on; so it keeps a CPU
copy of each version due for one (at most `MAX_PENDING`; the evaluations rarely lag further), and
when that version's row arrives it writes the copy as run_dir/best if it scores above every earlier
version, else drops it. run_dir/best is a Hugging Face model directory (the weights as the trainer
holds them, fp32; no optimizer state) with a meta.json naming the version, what it was chosen on
and its accuracies.

What a version is chosen on: its validation accuracy (`eval/val_accuracy`, `task.val_size`
problems that neither training nor the test set holds), so the test accuracy of the chosen
version is an unbiased score of the choice. A task without a validation set is chosen on its test
accuracy, and meta.json and the run's summary say so ("chosen_on"). Ties keep the earlier version.
An evaluation runs beside training and a newer version may arrive while it runs
(`eval/version_max` > its version): the row then scores a mixture, and the copy kept is the
version it began with (meta.json keeps `eval_version_max`). The trainer reads eval.jsonl from the
run directory: a rollout side writing elsewhere (another machine) leaves no rows to read, and no best.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

import torch

from async_rl.config import Config
from async_rl.trainer.checkpoint import save_checkpoint
from async_rl.utils.metrics import read_jsonl
from async_rl.utils.weights import as_source

logger = logging.getLogger(__name__)

BEST_DIR = "best"
MAX_PENDING = 2


def chosen_on(row: dict[str, Any]) -> tuple[float, str]:
    """(score, split) of an evaluation row: its validation accuracy where there is one, else its test accuracy."""
    if "eval/val_accuracy" in row:
        return float(row["eval/val_accuracy"]), "validation"
    return float(row["eval/accuracy"]), "test"


def read_best(run_dir: str | Path) -> dict[str, Any] | None:
    """run_dir/best/meta.json, or None where the run kept no best."""
    path = Path(run_dir) / BEST_DIR / "meta.json"
    return json.loads(path.read_text()) if path.is_file() else None


class BestKeeper:
    def __init__(self, cfg: Config):
        self.run_dir = Path(cfg.run_dir)
        self.every = cfg.rollout.eval_every if cfg.trainer.keep_best else 0
        self.total_steps = cfg.total_steps
        self.on = cfg.trainer.keep_best
        kept = read_best(self.run_dir) if cfg.trainer.resume else None  # a resumed run keeps its best so far
        self.best = float(kept["score"]) if kept else float("-inf")
        self.pending: dict[int, dict[str, torch.Tensor]] = {}
        # copies reused: a fresh 540 MB copy of SmolLM2 faults in every page (seconds on a loaded machine)
        self._free: list[dict[str, torch.Tensor]] = []
        self.seconds = 0.0  # the trainer's time spent here (copies and writes): timing/keep_best_s

    def after_publish(self, trainer: Any) -> None:
        """Keep a copy of the version just published if one of its evaluations is due; write what has reported."""
        t0 = time.perf_counter()
        v = trainer.policy_version
        if self.every > 0 and v > 0 and v % self.every == 0 and v < self.total_steps:
            self.pending[v] = self._copy(trainer)
            while len(self.pending) > MAX_PENDING:
                self._free.append(self.pending.pop(min(self.pending)))
        self._resolve(trainer)
        self.seconds += time.perf_counter() - t0

    def _copy(self, trainer: Any) -> dict[str, torch.Tensor]:
        """The trainer's weights now, on the CPU, into a reused copy where one is free (named as its
        state_dict; tied tensors one tensor)."""
        reuse = self._free.pop() if self._free else {}
        source = as_source(trainer.weights())  # views of the parameters (gathered, on a sharded trainer)
        try:
            out = {}
            for name in source.names:
                t, buf = source.get(name), reuse.get(name)
                fits = buf is not None and buf.shape == t.shape and buf.dtype == t.dtype
                out[name] = buf.copy_(t) if fits else t.detach().to("cpu", copy=True)
            for alias, kept in source.aliases.items():
                out[alias] = out[kept]
        finally:
            source.close()
        return out

    def finish(self, trainer: Any) -> None:
        """After the final evaluation: the versions still waiting, then the final one (the trainer's weights)."""
        if not self.on:
            return
        self._resolve(trainer)
        self.pending.clear()
        after = [r for r in read_jsonl(self.run_dir / "eval.jsonl")
                 if r.get("when") == "after" and r.get("policy_version") == trainer.policy_version]
        if after:
            self._offer(trainer.policy_version, after[-1], self._copy(trainer), trainer)
        self._free.clear()

    def _resolve(self, trainer: Any) -> None:
        if not self.pending:
            return
        rows = {r["policy_version"]: r for r in read_jsonl(self.run_dir / "eval.jsonl") if r.get("when") == "periodic"}
        newest = max(rows, default=-1)
        for v in sorted(self.pending):
            if v in rows:
                self._offer(v, rows[v], self.pending[v], trainer)
            elif v > newest:
                continue
            # evaluated, or skipped (a later version has a row: the evaluation before it was still running)
            self._free.append(self.pending.pop(v))

    def _offer(self, version: int, row: dict[str, Any], weights: dict[str, torch.Tensor], trainer: Any) -> None:
        score, split = chosen_on(row)
        if score <= self.best:
            return
        self.best = score
        meta = {"policy_version": version, "chosen_on": split, "score": score,
                "val_accuracy": row.get("eval/val_accuracy"), "test_accuracy": row.get("eval/accuracy"),
                "eval_version_max": row.get("eval/version_max", version)}
        save_checkpoint(self.run_dir / BEST_DIR, weights, None, version, meta,
                        hf_export=getattr(trainer, "hf_export", None))
        logger.info("best so far: version %d, %s accuracy %.3f -> %s", version, split, score, self.run_dir / BEST_DIR)
