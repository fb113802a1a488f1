"""One metrics logger for every process: JSONL lines, plus TensorBoard events where installed.

`MetricsLogger(run_dir / "metrics.jsonl", tensorboard=True)` appends one JSON object per
`log(stats, step)` and, when the `tensorboard` package is importable, writes the same row
as TensorBoard events under `run_dir/tensorboard/<file stem>/`: every finite number as a
scalar, every `*_hist` list (counts per integer bin 0..n-1, e.g. `train/staleness_hist`)
as a histogram over those bins, and every other list of numbers as a histogram of its
values. `read_jsonl` reads such a file back.
"""

from __future__ import annotations

import json
import logging
import math
import numbers
import time
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

HIST_SUFFIX = "_hist"  # a list under a key ending so holds counts per integer bin, not samples


def _is_number(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


class TensorBoardWriter:
    """Writes one metrics row as TensorBoard events (scalars and histograms) under `log_dir`."""

    def __init__(self, log_dir: str | Path, flush_secs: int = 10):
        from torch.utils.tensorboard import SummaryWriter  # needs the `tensorboard` package

        self.log_dir = Path(log_dir)
        self._writer = SummaryWriter(str(self.log_dir), flush_secs=flush_secs)

    def write(self, stats: dict[str, Any], step: int) -> None:
        for key, value in stats.items():
            if _is_number(value):
                if math.isfinite(value):
                    self._writer.add_scalar(key, float(value), step)
            elif isinstance(value, (list, tuple)) and value and all(_is_number(v) for v in value):
                if key.endswith(HIST_SUFFIX):
                    self._bin_counts(key, [float(v) for v in value], step)
                elif all(math.isfinite(v) for v in value):
                    import numpy as np

                    self._writer.add_histogram(key, np.asarray(value, dtype=np.float64), step)

    def _bin_counts(self, key: str, counts: list[float], step: int) -> None:
        """`counts[i]` values fell in integer bin i: a histogram with one bucket per bin."""
        num = sum(counts)
        if num <= 0 or not all(math.isfinite(c) and c >= 0 for c in counts):
            return
        used = [i for i, c in enumerate(counts) if c > 0]
        self._writer.add_histogram_raw(
            key, min=float(used[0]), max=float(used[-1]), num=num,
            sum=sum(i * c for i, c in enumerate(counts)), sum_squares=sum(i * i * c for i, c in enumerate(counts)),
            bucket_limits=[i + 0.5 for i in range(len(counts))], bucket_counts=counts, global_step=step)

    def close(self) -> None:
        self._writer.close()


class MetricsLogger:
    """Appends one JSON object per `log` call to `path`; keys are prefixed (`train/`, `queue/`, ...)."""

    def __init__(self, path: str | Path, *, tensorboard: bool = False):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fh = self.path.open("a", buffering=1)
        self._tb: TensorBoardWriter | None = None
        if tensorboard:
            try:
                self._tb = TensorBoardWriter(self.path.parent / "tensorboard" / self.path.stem)
            except ImportError:
                logger.info("tensorboard is not installed: %s alone (pip install tensorboard)", self.path.name)
            except Exception as exc:  # a broken install must not stop training: JSONL alone
                logger.warning("log.tensorboard: cannot write TensorBoard events (%s); %s alone", exc, self.path.name)

    @property
    def tensorboard_dir(self) -> Path | None:
        """Where TensorBoard events go, or None when they are not written."""
        return self._tb.log_dir if self._tb is not None else None

    def log(self, stats: dict[str, Any], step: int) -> None:
        row = {"step": step, "time": time.time()}
        for key, value in stats.items():
            if isinstance(value, float) and not math.isfinite(value):
                value = None
            row[key] = value
        self._fh.write(json.dumps(row) + "\n")
        if self._tb is not None:
            self._tb.write(stats, step)

    def close(self) -> None:
        self._fh.close()
        if self._tb is not None:
            self._tb.close()


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """The rows of a JSONL file ([] if it does not exist); a half-written last line (a live run) is skipped."""
    p = Path(path)
    if not p.is_file():
        return []
    lines = [line for line in p.read_text().splitlines() if line.strip()]
    rows = []
    for i, line in enumerate(lines):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as exc:
            if i == len(lines) - 1:
                logger.debug("%s: skipping a half-written last line", p)
                break
            raise ValueError(f"{p}: line {i + 1} is not JSON ({exc.msg})") from exc
    return rows
