"""A finished (or running) run directory read back as plain rows, with step and wall-time axes.

    run = load_run("runs/x")
    xs, ys = run.series("train", "train/reward_mean")            # over train steps
    xs, ys = run.series("train", "train/reward_mean", x="wall")  # over seconds since the trainer started

Three sources: `train` (metrics.jsonl, one row per train step), `rollout`
(rollout_metrics.jsonl, one row per weight update the rollout side loaded) and `eval`
(eval.jsonl: greedy accuracy before, after and, where configured, during training).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from async_rl.utils.metrics import read_jsonl

SOURCES = {"train": "metrics.jsonl", "rollout": "rollout_metrics.jsonl", "eval": "eval.jsonl"}
WALL_KEY = "timing/train_wall_s"  # seconds since the trainer started, where a row carries it
XLABELS = {"step": "train step", "wall": "wall time since the trainer started (s)"}


class RunDirError(ValueError):
    """The path is not a run directory with anything to report."""


@dataclass
class RunData:
    """The rows of one run; `rows[source]` is a list of dicts as the processes logged them."""

    run_dir: Path
    rows: dict[str, list[dict[str, Any]]]
    config: dict[str, Any] = field(default_factory=dict)

    @property
    def train(self) -> list[dict[str, Any]]:
        return self.rows["train"]

    @property
    def rollout(self) -> list[dict[str, Any]]:
        return self.rows["rollout"]

    @property
    def evals(self) -> list[dict[str, Any]]:
        return self.rows["eval"]

    def has(self, source: str, key: str) -> bool:
        return any(r.get(key) is not None for r in self.rows[source])

    def missing(self, source: str, *keys: str) -> list[str]:
        """`key (file)` for each key no row of `source` carries."""
        return [f"{k} ({SOURCES[source]})" for k in keys if not self.has(source, k)]

    def t0(self) -> float | None:
        """Unix time the trainer started: the first train row's time less its step time."""
        for row in self.train:
            if "time" in row:
                return row["time"] - (row.get("timing/step_s") or 0.0)
        return next((r["time"] for r in self.rollout if "time" in r), None)

    def x_of(self, source: str, row: dict[str, Any], x: str) -> float | None:
        """The row's position on axis `x` (`step` or `wall`), None when it has none."""
        if x == "step":
            if source == "eval":  # policy version v = the weights after v train steps
                return row.get("policy_version", row.get("step"))
            return row.get("step")
        if row.get(WALL_KEY) is not None:
            return float(row[WALL_KEY])
        if source == "eval":
            return self._eval_wall(row)
        t0 = self.t0()
        return row["time"] - t0 if "time" in row and t0 is not None else None

    def _eval_wall(self, row: dict[str, Any]) -> float | None:
        if row.get("when") == "before" or row.get("policy_version") == 0:
            return 0.0
        if row.get("when") == "after" and self.train:
            return self.x_of("train", self.train[-1], "wall")
        return None

    def series(self, source: str, key: str, x: str = "step") -> tuple[list[float], list[float]]:
        """(xs, ys) of every row of `source` that has both a position on `x` and a value for `key`."""
        xs, ys = [], []
        for row in self.rows[source]:
            pos, value = self.x_of(source, row, x), row.get(key)
            if pos is not None and isinstance(value, (int, float)) and not isinstance(value, bool):
                xs.append(float(pos))
                ys.append(float(value))
        return xs, ys

    def values(self, source: str, key: str) -> list[Any]:
        return [r[key] for r in self.rows[source] if r.get(key) is not None]

    def label(self) -> str:
        mode = self.config.get("mode")
        if mode is None:
            return self.run_dir.name
        return f"{mode}" + (f" η={self.config.get('max_staleness')}" if mode == "async" else "")


def _load_config(run_dir: Path) -> dict[str, Any]:
    path = run_dir / "config.yaml"
    if not path.is_file():
        return {}
    from omegaconf import OmegaConf

    try:
        loaded = OmegaConf.to_container(OmegaConf.load(path))
    except Exception:  # a hand-edited or truncated config only costs the summary its config rows
        return {}
    return loaded if isinstance(loaded, dict) else {}


def load_run(run_dir: str | Path) -> RunData:
    """Reads a run directory; RunDirError names what is missing when there is nothing to report."""
    path = Path(run_dir)
    if not path.is_dir():
        raise RunDirError(f"RUN_DIR: {path} is not a directory (a run directory is made by `async-rl run`)")
    try:
        rows = {source: read_jsonl(path / name) for source, name in SOURCES.items()}
    except ValueError as exc:
        raise RunDirError(f"RUN_DIR: {exc}") from exc
    if not any(rows.values()):
        names = ", ".join(SOURCES.values())
        raise RunDirError(f"RUN_DIR: {path} has no metrics yet (none of {names} has a row); "
                          f"is it the run_dir of an `async-rl run`?")
    return RunData(run_dir=path, rows=rows, config=_load_config(path))
