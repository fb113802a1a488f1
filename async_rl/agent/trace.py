"""Readable per-turn traces of agent episodes: every Nth episode, one JSON line each.

    trace = TraceWriter(run_dir / "traces.jsonl", every=10)   # rollout.trace_every
    trace({"sample_id": ..., "turns": [{"role": "assistant", "text": ..., "mask": [s, e], ...}], ...})

Loops call it for every episode; the writer keeps one in `every` and appends it (line-buffered,
so a crashed run keeps what it wrote).
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any


class TraceWriter:
    def __init__(self, path: str | Path, every: int):
        if every < 1:
            raise ValueError(f"rollout.trace_every: must be >= 1 to trace, got {every}")
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.every = every
        self.seen = 0
        self.written = 0
        self._lock = threading.Lock()
        self._file = self.path.open("a", buffering=1)

    def __call__(self, record: dict[str, Any]) -> None:
        with self._lock:
            self.seen += 1
            if (self.seen - 1) % self.every:
                return
            self._file.write(json.dumps(record, ensure_ascii=False, default=str) + "\n")
            self.written += 1

    def close(self) -> None:
        with self._lock:
            self._file.close()
