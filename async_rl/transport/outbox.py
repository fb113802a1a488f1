"""The rollout side's durable outbox: every group stays on disk until the trainer acknowledges it.

    outbox = Outbox(run_dir / "outbox", run_id)      # run_id: the trainer's (from WELCOME)
    outbox.put(group)                                # before the group is sent
    outbox.ack(ids)                                  # the trainer consumed them (a CREDIT's acks)
    for group in outbox.pending(): ...               # after a restart: send these again first

One file per group (`<first trajectory id>.grp`, the codec's bytes of the trajectories' wire
forms), written atomically, removed once every trajectory of the group is acknowledged. A
rollout side killed at any moment therefore loses nothing it produced: the restarted side
finds the files and sends them again; the trainer drops (and acknowledges) ids it already
has, so nothing is trained twice. The outbox belongs to one run: files written for another
trainer run (`run_id`) are discarded, never sent to the wrong trainer.

A rollout side is its run directory: `claim_side(run_dir)` takes the directory's lock (held
until the process exits, however it exits) and names the side by host and directory, so a
restarted side says HELLO under the same producer id and the trainer replaces the dead one's
session at once instead of waiting `transport.peer_timeout_s` for it. A second live side on
the same directory would share the outbox: it is refused.

    producer_id = claim_side(cfg.run_dir)     # before connecting to the trainer
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import shutil
import socket
from pathlib import Path

from async_rl.transport.codec import decode, encode
from async_rl.types import Trajectory, WireFormatError

logger = logging.getLogger(__name__)


_held: list = []  # the lock files of the sides this process claimed (open for the process's life)


class SideTakenError(RuntimeError):
    """Another live rollout side uses the same run directory."""


def claim_side(run_dir: str | Path) -> str:
    """Lock `run_dir` for this process's rollout side; its producer id, the same after a restart."""
    root = Path(run_dir).resolve()
    root.mkdir(parents=True, exist_ok=True)
    lock = (root / "rollout.lock").open("a+")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        owner = lock.read().strip() or "?"
        lock.close()
        raise SideTakenError(f"run_dir={root}: another rollout side (pid {owner}) uses it and its outbox; give "
                             "each rollout side its own run_dir") from None
    lock.seek(0)
    lock.truncate()
    lock.write(str(os.getpid()))
    lock.flush()
    _held.append(lock)
    digest = hashlib.sha1(str(root).encode()).hexdigest()[:8]
    return f"{socket.gethostname()[:40]}-{digest}"


class Outbox:
    def __init__(self, directory: str | Path, run_id: str):
        self.dir = Path(directory)
        owner = self.dir / "run_id"
        if self.dir.is_dir() and (not owner.is_file() or owner.read_text() != run_id):
            stale = len(list(self.dir.glob("*.grp")))
            if stale:
                logger.warning("outbox %s: %d groups of another run discarded", self.dir, stale)
            shutil.rmtree(self.dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        owner.write_text(run_id)
        self._file_of: dict[str, Path] = {}  # trajectory id -> its group's file
        self._open: dict[Path, set[str]] = {}  # file -> ids not acknowledged yet

    def _track(self, path: Path, ids: list[str]) -> None:
        self._open[path] = set(ids)
        for tid in ids:
            self._file_of[tid] = path

    def put(self, group: list[Trajectory]) -> None:
        path = self.dir / f"{group[0].id}.grp"
        tmp = path.with_suffix(".tmp")
        with tmp.open("wb") as f:
            f.write(encode([t.to_wire() for t in group]))
            f.flush()
            os.fsync(f.fileno())
        tmp.replace(path)
        self._track(path, [t.id for t in group])

    def ack(self, ids: list[str]) -> None:
        for tid in ids:
            path = self._file_of.pop(tid, None)
            if path is None:
                continue
            left = self._open.get(path)
            if left is not None:
                left.discard(tid)
                if not left:
                    del self._open[path]
                    path.unlink(missing_ok=True)

    def pending(self) -> list[list[Trajectory]]:
        """Groups a previous incarnation produced that the trainer never acknowledged, oldest first."""
        groups = []
        for path in sorted(self.dir.glob("*.grp"), key=lambda p: p.stat().st_mtime):
            try:
                group = [Trajectory.from_wire(d) for d in decode(path.read_bytes())]
            except (WireFormatError, ValueError, TypeError) as exc:  # cut by a crash mid-write: never sent
                logger.warning("outbox %s: unreadable (%s): dropped", path.name, exc)
                path.unlink(missing_ok=True)
                continue
            self._track(path, [t.id for t in group])
            groups.append(group)
        return groups

    def open_ids(self) -> list[str]:
        """Ids put here and not acknowledged (sent or still waiting to be)."""
        return list(self._file_of)

    def clear(self) -> None:
        """The run ended normally: what is left was reported untrained; nothing to send again."""
        for path in self.dir.glob("*.grp"):
            path.unlink(missing_ok=True)
        self._file_of.clear()
        self._open.clear()
