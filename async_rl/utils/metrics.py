"""One metrics logger for every process: JSONL lines, plus TensorBoard where installed."""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


class MetricsLogger:
    """Appends one JSON object per `log` call to `path`; keys are prefixed (`train/`, `queue/`, ...)."""

    def __init__(self, path: str | Path, *, tensorboard: bool = False):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fh = self.path.open("a", buffering=1)
        self._tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
                self._tb = SummaryWriter(str(self.path.parent / "tensorboard" / self.path.stem))
            except Exception:  # tensorboard not installed: JSONL alone
                self._tb = None

    def log(self, stats: dict[str, Any], step: int) -> None:
        row = {"step": step, "time": time.time()}
        for key, value in stats.items():
            if isinstance(value, float) and not math.isfinite(value):
                value = None
            row[key] = value
        self._fh.write(json.dumps(row) + "\n")
        if self._tb is not None:
            for key, value in stats.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    self._tb.add_scalar(key, value, step)

    def close(self) -> None:
        self._fh.close()
        if self._tb is not None:
            self._tb.close()


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    p = Path(path)
    if not p.is_file():
        return []
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()]
