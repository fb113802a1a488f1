"""The run's trajectory ledger and its audit: was anything lost, was anything trained twice?

Each side appends what happened to trajectory ids, one JSON line per event, to its own file
in its run directory (line-buffered, so a process killed mid-run keeps what it wrote):

    ledger_rollout.jsonl  produced (pushed to the trainer), acked (the trainer consumed them),
                          untrained_at_end (produced after the trainer's last step, reported),
                          abandoned_groups (admitted, unfinished when the run ended: a count)
    ledger_trainer.jsonl  trained (step k), dropped_stale (over the bound: counted, not trained),
                          rolled_back (trained after the checkpoint a resumed run went back to)

`audit(dirs)` reads every ledger under the given run directories (the two sides of a
two-shell run may write to different ones) and counts:

- lost: produced ids that were neither trained, dropped (counted), rolled back nor reported
  untrained at the end;
- duplicated: ids trained more than once (rolled-back training does not count).
"""

from __future__ import annotations

import json
import threading
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

LEDGERS = ("ledger_rollout.jsonl", "ledger_trainer.jsonl")


class Ledger:
    """Append-only event log of trajectory ids (thread-safe)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._file = self.path.open("a", buffering=1)

    def record(self, event: str, ids: Iterable[str] = (), **extra: Any) -> None:
        row = {"event": event, "ids": list(ids), **extra}
        with self._lock:
            if not self._file.closed:
                self._file.write(json.dumps(row) + "\n")

    def close(self) -> None:
        with self._lock:
            self._file.close()


def read_events(path: Path) -> list[dict[str, Any]]:
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:  # a line cut by a kill -9: the events before it stand
            continue
    return rows


def roll_back(path: str | Path, from_step: int) -> int:
    """A resumed trainer goes back to `from_step`: its later training is marked rolled back; returns how many ids."""
    p = Path(path)
    if not p.is_file():
        return 0
    ids = [i for r in read_events(p) if r["event"] == "trained" and r.get("step", -1) >= from_step for i in r["ids"]]
    ledger = Ledger(p)
    ledger.record("rolled_back", ids, from_step=from_step)
    ledger.close()
    return len(ids)


def trained_ids(path: str | Path) -> list[str]:
    """Ids trained and not rolled back, per a trainer ledger (a resumed trainer never trains them again)."""
    p = Path(path)
    if not p.is_file():
        return []
    count: Counter[str] = Counter()
    for r in read_events(p):
        if r["event"] in ("trained", "rolled_back"):
            count.update({i: 1 if r["event"] == "trained" else -1 for i in r["ids"]})
    return [i for i, n in count.items() if n > 0]


@dataclass
class AuditResult:
    produced: int = 0
    trained: int = 0
    dropped_stale: int = 0
    rolled_back: int = 0
    untrained_at_end: int = 0
    abandoned_groups: int = 0
    lost_ids: list[str] = field(default_factory=list)
    duplicated_ids: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.lost_ids and not self.duplicated_ids

    def lines(self) -> list[str]:
        return [f"produced={self.produced} trained={self.trained} dropped_stale={self.dropped_stale} "
                f"rolled_back={self.rolled_back} untrained_at_end={self.untrained_at_end} "
                f"abandoned_groups={self.abandoned_groups}",
                f"lost={len(self.lost_ids)} duplicated={len(self.duplicated_ids)}"]


def audit(run_dirs: Iterable[str | Path]) -> AuditResult:
    events: list[dict[str, Any]] = []
    found = False
    for d in run_dirs:
        for name in LEDGERS:
            p = Path(d) / name
            if p.is_file():
                found = True
                events += read_events(p)
    if not found:
        raise ValueError(f"no ledger ({' or '.join(LEDGERS)}) in {', '.join(map(str, run_dirs))}")
    by = {kind: [i for e in events if e["event"] == kind for i in e["ids"]]
          for kind in ("produced", "trained", "dropped_stale", "rolled_back", "untrained_at_end")}
    trained = Counter(by["trained"])
    trained.subtract(Counter(by["rolled_back"]))
    live = {i for i, n in trained.items() if n > 0}
    accounted = live | set(by["dropped_stale"]) | set(by["rolled_back"]) | set(by["untrained_at_end"])
    return AuditResult(
        produced=len(set(by["produced"])), trained=len(live), dropped_stale=len(set(by["dropped_stale"])),
        rolled_back=len(set(by["rolled_back"])), untrained_at_end=len(set(by["untrained_at_end"])),
        abandoned_groups=sum(int(e.get("count", 0)) for e in events if e["event"] == "abandoned_groups"),
        lost_ids=sorted(set(by["produced"]) - accounted), duplicated_ids=sorted(i for i, n in trained.items() if n > 1))
