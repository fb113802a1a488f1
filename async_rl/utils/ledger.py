"""The run's trajectory ledger and its audit: was anything lost, was anything trained twice?

Each side appends what happened to trajectory ids, one JSON line per event, to its own file
in its run directory (line-buffered, so a process killed mid-run keeps what it wrote):

    ledger_rollout.jsonl  side (this side's producer id), produced (one group: ids + its prompt),
                          discarded (groups sampled by weights a trainer resume threw away: their
                          prompts are generated again), untrained_at_end (produced after the
                          trainer's last step, reported), abandoned_groups (admitted, unfinished
                          when the run ended: a count and their prompts)
    ledger_trainer.jsonl  session (a producer joined), trained / dropped_stale / dropped_future /
                          filtered (step k: ids and their prompts; filtered = a group without
                          reward variance set aside while step k's batch was filled, dynamic
                          sampling), committed (a checkpoint at step k made everything before it
                          durable), resumed (from_step k: a restarted trainer
                          went back to the checkpoint of step k; every later event is undone)

`audit(dirs)` reads every ledger under the given run directories and judges the FINAL
history: the trainer's events replayed in order, each `resumed` marker cutting off the
events of the steps it went back over. In that history every produced id must be

- trained exactly once, or dropped (over-stale, or sampled by weights newer than the
  trainer's), or filtered (dynamic sampling), or discarded by its side, or reported
  untrained at the end, or
- replaced: never delivered, and its prompt consumed through another group (a side that
  died with what it admitted; the next side generated the prompt again);

anything else is `lost`, training undone by a resume and never redone included. Ids trained
more than once are `duplicated`. By prompt: every stream position up to the highest one seen
must be consumed once (or reported untrained or abandoned at the end); a position consumed
through two groups is a duplicated prompt, one never consumed a lost prompt. A side the
trainer heard from whose rollout ledger is not among the directories makes the audit
incomplete (not ok): it cannot vouch for ids it cannot see.
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
# trainer events that use up an id (and its prompt)
CONSUMED = ("trained", "dropped_stale", "dropped_future", "filtered")


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
            row = json.loads(line)
        except json.JSONDecodeError:  # a line cut by a kill -9: the events before it stand
            continue
        if isinstance(row, dict) and "event" in row:
            rows.append(row)
    return rows


def final_history(events: Iterable[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[str]]:
    """The trainer's consuming events that survive every resume, in order, and the ids whose
    training a resume undid (each time it was undone)."""
    history: list[dict[str, Any]] = []
    undone: list[str] = []
    for e in events:
        kind = e["event"]
        if kind in CONSUMED:
            history.append(e)
        elif kind in ("resumed", "rolled_back"):  # rolled_back: what earlier versions wrote at a resume
            k = int(e.get("from_step", 0))
            undone += [i for h in history if h["event"] == "trained" and h.get("step", -1) >= k for i in h["ids"]]
            history = [h for h in history if h.get("step", -1) < k]
    return history, undone


def _prompts(e: dict[str, Any]) -> list[int | None]:
    prompts = e.get("prompts")
    return list(prompts) if isinstance(prompts, list) and len(prompts) == len(e["ids"]) else [None] * len(e["ids"])


def committed_state(path: str | Path, from_step: int) -> tuple[list[str], list[int]]:
    """What a trainer resuming at `from_step` has consumed, per its ledger: (ids, prompt positions).
    A producer that sends those ids again gets them acknowledged, never trained twice, and a side
    that joins does not generate those prompts again."""
    p = Path(path)
    if not p.is_file():
        return [], []
    history, _ = final_history([*read_events(p), {"event": "resumed", "from_step": from_step}])
    ids = [i for e in history for i in e["ids"]]
    prompts = sorted({q for e in history for q in _prompts(e) if q is not None})
    return ids, prompts


@dataclass
class AuditResult:
    produced: int = 0
    trained: int = 0
    dropped_stale: int = 0
    dropped_future: int = 0
    filtered: int = 0
    discarded: int = 0
    replaced: int = 0
    rolled_back: int = 0
    untrained_at_end: int = 0
    abandoned_groups: int = 0
    prompts: int = 0  # stream positions the audit could follow
    lost_ids: list[str] = field(default_factory=list)
    duplicated_ids: list[str] = field(default_factory=list)
    lost_prompts: list[int] = field(default_factory=list)
    duplicated_prompts: list[int] = field(default_factory=list)
    missing_sides: list[str] = field(default_factory=list)  # producers the trainer heard, with no ledger here

    @property
    def ok(self) -> bool:
        return not (self.lost_ids or self.duplicated_ids or self.lost_prompts or self.duplicated_prompts
                    or self.missing_sides)

    def lines(self) -> list[str]:
        out = [f"produced={self.produced} trained={self.trained} dropped_stale={self.dropped_stale} "
               f"dropped_future={self.dropped_future} filtered={self.filtered} discarded={self.discarded} "
               f"replaced={self.replaced} rolled_back={self.rolled_back} untrained_at_end={self.untrained_at_end} "
               f"abandoned_groups={self.abandoned_groups}",
               f"lost={len(self.lost_ids)} duplicated={len(self.duplicated_ids)} "
               f"lost_prompts={len(self.lost_prompts)} duplicated_prompts={len(self.duplicated_prompts)} "
               f"(of {self.prompts} prompts)"]
        if self.missing_sides:
            out.append(f"incomplete: no rollout ledger for side(s) {', '.join(self.missing_sides)} in these "
                       "directories; pass every side's run_dir to vouch for what they produced")
        return out


def _read_all(run_dirs: Iterable[str | Path]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    rollout: list[dict[str, Any]] = []
    trainer: list[dict[str, Any]] = []
    dirs = [Path(d) for d in run_dirs]
    found = False
    for d in dirs:
        for name, into in zip(LEDGERS, (rollout, trainer)):
            if (d / name).is_file():
                found = True
                into += read_events(d / name)
    if not found:
        raise ValueError(f"no ledger ({' or '.join(LEDGERS)}) in {', '.join(map(str, dirs))}")
    return rollout, trainer


def audit(run_dirs: Iterable[str | Path]) -> AuditResult:
    rollout, trainer = _read_all(run_dirs)
    history, undone = final_history(trainer)
    by_kind = {k: [i for e in history if e["event"] == k for i in e["ids"]] for k in CONSUMED}
    trained = Counter(by_kind["trained"])
    consumed = set(trained) | {i for k in CONSUMED if k != "trained" for i in by_kind[k]}
    produced_events = [e for e in rollout if e["event"] == "produced"]
    produced = {i for e in produced_events for i in e["ids"]}
    prompt_of = {i: e.get("prompt") for e in produced_events for i in e["ids"]}
    group_of = {i: n for n, e in enumerate(produced_events) for i in e["ids"]}
    for e in history:  # the trainer's own record of prompts: a side whose ledger is missing
        for i, q in zip(e["ids"], _prompts(e)):
            prompt_of.setdefault(i, q)
    reported = {i for e in rollout if e["event"] in ("untrained_at_end", "discarded") for i in e["ids"]}
    consumed_prompts: dict[int, set[Any]] = {}
    for i in consumed:
        q = prompt_of.get(i)
        if q is not None:
            consumed_prompts.setdefault(q, set()).add(group_of.get(i, -1))  # -1: no rollout ledger says
    replaced = {i for i in produced - consumed - reported  # its prompt consumed through another group
                if consumed_prompts.get(prompt_of.get(i), set()) - {group_of[i]}}
    ended = {prompt_of.get(i) for e in rollout if e["event"] == "untrained_at_end" for i in e["ids"]}
    ended |= {q for e in rollout if e["event"] == "abandoned_groups" for q in e.get("prompts", [])}
    seen_prompts = {q for q in prompt_of.values() if q is not None} | set(consumed_prompts)
    top = max(seen_prompts, default=-1)
    sides = {e["producer"] for e in rollout if e["event"] == "side" and "producer" in e}
    heard = {e["producer"] for e in trainer if e["event"] == "session" and "producer" in e}
    return AuditResult(
        produced=len(produced), trained=len(trained), dropped_stale=len(set(by_kind["dropped_stale"])),
        dropped_future=len(set(by_kind["dropped_future"])), filtered=len(set(by_kind["filtered"])),
        discarded=len({i for e in rollout if e["event"] == "discarded" for i in e["ids"]}),
        replaced=len(replaced), rolled_back=len(set(undone)),
        untrained_at_end=len({i for e in rollout if e["event"] == "untrained_at_end" for i in e["ids"]}),
        abandoned_groups=sum(int(e.get("count", 0)) for e in rollout if e["event"] == "abandoned_groups"),
        prompts=top + 1,
        lost_ids=sorted(produced - consumed - reported - replaced),
        duplicated_ids=sorted(i for i, n in trained.items() if n > 1),
        lost_prompts=[q for q in range(top + 1) if q not in consumed_prompts and q not in ended],
        duplicated_prompts=sorted(q for q, groups in consumed_prompts.items() if len(groups) > 1),
        missing_sides=sorted(heard - sides) if trainer else [])
