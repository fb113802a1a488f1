"""The run's trajectory ledger and its audit: was anything lost, invented, or trained twice?

Each side appends what happened to trajectory ids, one JSON line per event, to its own file
in its run directory (line-buffered, so a process killed mid-run keeps what it wrote):

    ledger_rollout.jsonl  side (this side's producer name and identity: its CURVE key, or its name),
                          produced (one group: ids + its prompt), refused (a group this side would not
                          send: a non-finite score, too large a frame; with the reason), discarded (groups
                          sampled by weights a trainer resume threw away: their prompts are generated
                          again), untrained_at_end (still in the outbox when the run ended), abandoned_groups
                          (admitted, unfinished when the run ended: a count and their prompts)
    ledger_trainer.jsonl  session (a producer joined: its name and identity), received (a group taken in:
                          ids, prompts, the identity that delivered it), refused (a group the trainer would
                          not take: malformed, non-finite, beyond its producer's credits; with the reason),
                          trained / dropped_stale / dropped_future / filtered (step k: ids and their prompts;
                          filtered = a group without reward variance set aside while step k's batch was filled,
                          dynamic sampling), committed (a checkpoint at step k made everything before it
                          durable), resumed (from_step k: a restarted trainer went back to the checkpoint of
                          step k; every later consumption is undone), held_at_end (received, not consumed
                          when the trainer ended)

`audit(dirs)` reads every ledger under the given run directories and judges the FINAL
history: the trainer's consumptions replayed in order, each `resumed` marker cutting off
those of the steps it went back over. A group is *delivered* once the trainer received or
refused it (in any history: a resume undoes training, not delivery). In the final history
every produced id must be

- trained exactly once, or dropped (over-stale, or sampled by weights newer than the
  trainer's), or filtered (dynamic sampling), or discarded by its side, or
- untrained at the end: delivered and held by the trainer when it ended, or never delivered
  and still in line when the run ended (no later group of its side was delivered: a side
  sends in order, so an older group left unsent is a group it failed to send), or
- replaced: never delivered, and its prompt consumed through another group (a side that
  died with what it admitted; the next side generated the prompt again);

anything else is `lost`, training undone by a resume and never redone included. A refused
group is lost unless its prompt was consumed through another group. Ids trained more than
once are `duplicated`; ids received or trained that no side produced, or that another side
produced than the identity that delivered them, are `invented` (a peer that took a name).
By prompt: every stream position up to the highest one seen must be consumed once (or be
untrained or abandoned at the end); a position consumed through two groups is a duplicated
prompt, one never consumed a lost prompt. A side the trainer heard from whose rollout ledger
is not among the directories makes the audit incomplete (not ok): it cannot vouch for ids it
cannot see.
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
    refused: int = 0  # ids of refused groups (either side), never consumed
    prompts: int = 0  # stream positions the audit could follow
    lost_ids: list[str] = field(default_factory=list)
    duplicated_ids: list[str] = field(default_factory=list)
    invented_ids: list[str] = field(default_factory=list)  # delivered, produced by no side or by another one
    lost_prompts: list[int] = field(default_factory=list)
    duplicated_prompts: list[int] = field(default_factory=list)
    missing_sides: list[str] = field(default_factory=list)  # producers the trainer heard, with no ledger here
    refusals: dict[str, int] = field(default_factory=dict)  # why groups were refused: reason -> ids

    @property
    def ok(self) -> bool:
        return not (self.lost_ids or self.duplicated_ids or self.invented_ids or self.lost_prompts
                    or self.duplicated_prompts or self.missing_sides)

    def lines(self) -> list[str]:
        out = [f"produced={self.produced} trained={self.trained} dropped_stale={self.dropped_stale} "
               f"dropped_future={self.dropped_future} filtered={self.filtered} discarded={self.discarded} "
               f"replaced={self.replaced} rolled_back={self.rolled_back} untrained_at_end={self.untrained_at_end} "
               f"abandoned_groups={self.abandoned_groups} refused={self.refused}",
               f"lost={len(self.lost_ids)} duplicated={len(self.duplicated_ids)} "
               f"lost_prompts={len(self.lost_prompts)} duplicated_prompts={len(self.duplicated_prompts)} "
               f"invented={len(self.invented_ids)} (of {self.prompts} prompts)"]
        for reason, n in sorted(self.refusals.items(), key=lambda kv: -kv[1])[:3]:
            out.append(f"refused {n}: {reason}")
        if self.missing_sides:
            out.append(f"incomplete: no rollout ledger for side(s) {', '.join(self.missing_sides)} in these "
                       "directories; pass every side's run_dir to vouch for what they produced")
        return out


def _read_all(run_dirs: Iterable[str | Path]) -> tuple[list[list[dict[str, Any]]], list[dict[str, Any]]]:
    """The rollout ledgers (one event list per file: a file is one side) and the trainer's events."""
    rollout: list[list[dict[str, Any]]] = []
    trainer: list[dict[str, Any]] = []
    dirs = [Path(d) for d in run_dirs]
    for d in dirs:
        if (d / LEDGERS[0]).is_file():
            rollout.append(read_events(d / LEDGERS[0]))
        if (d / LEDGERS[1]).is_file():
            trainer += read_events(d / LEDGERS[1])
    if not rollout and not trainer:
        raise ValueError(f"no ledger ({' or '.join(LEDGERS)}) in {', '.join(map(str, dirs))}")
    return rollout, trainer


@dataclass
class _Sides:
    """What the rollout ledgers say: every group produced, by which side, where in that side's order."""

    group_of: dict[str, int] = field(default_factory=dict)  # id -> its group (numbered over all files)
    prompt_of: dict[str, Any] = field(default_factory=dict)
    maker: dict[str, str] = field(default_factory=dict)  # id -> identity of the side that produced it
    place: list[tuple[int, int]] = field(default_factory=list)  # group -> (its file, its place in the file)
    identities: set[str] = field(default_factory=set)
    ids: dict[str, set[str]] = field(default_factory=dict)  # event kind -> its ids
    abandoned: int = 0
    abandoned_prompts: set[Any] = field(default_factory=set)
    reasons: Counter = field(default_factory=Counter)


def _read_sides(files: list[list[dict[str, Any]]]) -> _Sides:
    sides = _Sides()
    for f, events in enumerate(files):
        who, place = "", 0
        for e in events:
            kind, ids = e["event"], e.get("ids", [])
            sides.ids.setdefault(kind, set()).update(ids)
            if kind == "side":
                who = e.get("identity") or e.get("producer", "")
                sides.identities.add(who)
            elif kind == "produced":
                for i in ids:
                    sides.group_of[i], sides.prompt_of[i], sides.maker[i] = len(sides.place), e.get("prompt"), who
                sides.place.append((f, place))
                place += 1
            elif kind == "refused":
                sides.reasons[str(e.get("reason", "?"))] += len(ids)
            elif kind == "abandoned_groups":
                sides.abandoned += int(e.get("count", 0))
                sides.abandoned_prompts.update(e.get("prompts", []))
    return sides


def audit(run_dirs: Iterable[str | Path]) -> AuditResult:
    files, trainer = _read_all(run_dirs)
    sides = _read_sides(files)
    history, undone = final_history(trainer)
    by_kind = {k: [i for e in history if e["event"] == k for i in e["ids"]] for k in CONSUMED}
    trained = Counter(by_kind["trained"])
    consumed = set(trained) | {i for k in CONSUMED if k != "trained" for i in by_kind[k]}
    produced, prompt_of, group_of = set(sides.group_of), sides.prompt_of, sides.group_of
    for e in history:  # the trainer's own record of prompts: a side whose ledger is missing
        for i, q in zip(e["ids"], _prompts(e)):
            prompt_of.setdefault(i, q)
    delivered_by = {i: e.get("identity") for e in trainer if e["event"] == "received" for i in e["ids"]}
    trainer_refused = {i for e in trainer if e["event"] == "refused" for i in e["ids"]}
    delivered = set(delivered_by) | trainer_refused | {i for e in trainer if e["event"] in CONSUMED for i in e["ids"]}
    last_resume = max((n for n, e in enumerate(trainer) if e["event"] == "resumed"), default=-1)
    held = {i for e in trainer[last_resume + 1:] if e["event"] == "held_at_end" for i in e["ids"]}
    last_out: dict[int, int] = {}  # file -> place of its last group that reached the trainer
    for i in delivered & produced:
        f, place = sides.place[group_of[i]]
        last_out[f] = max(last_out.get(f, -1), place)

    def in_line(i: str) -> bool:  # never delivered, and nothing its side produced after it was
        f, place = sides.place[group_of[i]]
        return i not in delivered and place > last_out.get(f, -1)

    consumed_prompts: dict[Any, set[int]] = {}
    for i in consumed:
        if (q := prompt_of.get(i)) is not None:
            consumed_prompts.setdefault(q, set()).add(group_of.get(i, -1))  # -1: no rollout ledger says

    def elsewhere(i: str) -> bool:  # its prompt was consumed through another group
        return bool(consumed_prompts.get(prompt_of.get(i), set()) - {group_of[i]})

    refused = (sides.ids.get("refused", set()) | trainer_refused) - consumed
    discarded = sides.ids.get("discarded", set())
    untrained = {i for i in sides.ids.get("untrained_at_end", set()) & produced - consumed - refused
                 if i in held or in_line(i)}
    replaced = {i for i in produced - consumed - discarded - untrained - refused if i not in delivered and elsewhere(i)}
    lost = produced - consumed - discarded - untrained - replaced - {i for i in refused & produced if elsewhere(i)}
    ended = {prompt_of.get(i) for i in untrained} | sides.abandoned_prompts
    seen_prompts = {q for q in prompt_of.values() if q is not None} | set(consumed_prompts)
    top = max(seen_prompts, default=-1)
    heard = {e.get("identity") or e.get("producer") for e in trainer if e["event"] == "session"} - {None}
    missing = sorted(heard - sides.identities) if files or trainer else []
    invented = {i for i, who in delivered_by.items()
                if (i in produced and who is not None and sides.maker[i] != who)
                or (i not in produced and who not in missing)}
    if not missing:
        invented |= consumed - produced
    reasons = sides.reasons + Counter(str(e.get("reason", "?")) for e in trainer if e["event"] == "refused"
                                      for _ in e["ids"])
    return AuditResult(
        produced=len(produced), trained=len(trained), dropped_stale=len(set(by_kind["dropped_stale"])),
        dropped_future=len(set(by_kind["dropped_future"])), filtered=len(set(by_kind["filtered"])),
        discarded=len(discarded), replaced=len(replaced), rolled_back=len(set(undone)),
        untrained_at_end=len(untrained), abandoned_groups=sides.abandoned, refused=len(refused & produced),
        prompts=top + 1, lost_ids=sorted(lost), duplicated_ids=sorted(i for i, n in trained.items() if n > 1),
        invented_ids=sorted(invented),
        lost_prompts=[q for q in range(top + 1) if q not in consumed_prompts and q not in ended],
        duplicated_prompts=sorted(q for q, groups in consumed_prompts.items() if len(groups) > 1),
        missing_sides=missing, refusals=dict(reasons))
