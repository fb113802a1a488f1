"""What the trajectory queue knows of its peers, and the checks and errors both ends share.

`_Producer` is the trainer side's record of one rollout producer (its credits and what it sent in
this session); `_RecentIds` the bounded set of trajectory ids already received, which is how a
re-sent group is recognised and dropped. The address and timing checks run where either end is
built, so a bad `transport.*` value is one error naming the key.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from async_rl.transport.codec import decode
from async_rl.types import WireFormatError
from async_rl.utils.prompts import prompt_of


class QueueTimeout(TimeoutError):
    """What the training loop waited for did not arrive in time."""


class PeerUnreachableError(ConnectionError):
    """Nothing answered at the trainer's address."""


class PeerTimeoutError(ConnectionError):
    """The trainer stopped answering (no message for peer_timeout_s)."""


def _check_addr(addr: str) -> str:
    if not isinstance(addr, str) or not addr.startswith(("tcp://", "ipc://", "inproc://")):
        raise ValueError(f"transport.addr: expected tcp://HOST:PORT, ipc://PATH or inproc://NAME, got {addr!r}")
    return addr


def _check_timing(heartbeat_s: float, peer_timeout_s: float) -> None:
    if not heartbeat_s > 0:
        raise ValueError(f"transport.heartbeat_s: must be > 0, got {heartbeat_s}")
    if not peer_timeout_s > heartbeat_s:
        raise ValueError(f"transport.peer_timeout_s: must exceed heartbeat_s ({heartbeat_s}), got {peer_timeout_s}")


class _RecentIds:
    """The last `limit` trajectory ids received: a bounded set for dropping re-sent duplicates."""

    def __init__(self, limit: int):
        self.limit = limit
        self._set: set[str] = set()
        self._order: deque[str] = deque()

    def __contains__(self, tid: str) -> bool:
        return tid in self._set

    def add(self, tid: str) -> None:
        self._set.add(tid)
        self._order.append(tid)
        if len(self._order) > self.limit:
            self._set.discard(self._order.popleft())


@dataclass
class _Producer:
    identity: bytes  # its zmq routing id
    name: str  # the name it says in HELLO
    who: str = ""  # who it is: its CURVE public key when keys are on, else its name (the trainer's ledger)
    granted: int = 0  # credits granted in this session (cumulative)
    received: int = 0  # trajectories received in this session (cumulative, duplicates included)
    want: int = 0  # cumulative credits it needs to send its next group; waiting while want > granted
    waiting_since: float = 0.0
    last_seen: float = field(default_factory=time.monotonic)

    log_window: float = 0.0  # when its current 10 s window of refusal lines began (monotonic)
    logged: int = 0  # refusal lines of it in that window

    @property
    def held(self) -> int:
        return max(0, self.granted - self.received)

    def may_log(self, most: int = 10, window_s: float = 10.0) -> bool:
        """A line for each refused group, but at most `most` per `window_s` from one producer (a flood is counted)."""
        now = time.monotonic()
        if now - self.log_window > window_s:
            self.log_window, self.logged = now, 0
        self.logged += 1
        return self.logged <= most


# bytes of one trajectory on the wire: per token its id (int32); per response token also its loss mask (uint8),
# behaviour log-prob (float32) and version (int32); per trajectory its ids, reward, timings, info and framing
_TOKEN_BYTES = 4 + 1 + 4 + 4
_TRAJECTORY_BYTES = 64 << 10
FRAME_HEADROOM = 2


def group_frame_limit(group_size: int, max_tokens: int) -> int:
    """The largest GROUP frame a trainer takes (its socket's MAXMSGSIZE): `group_size` trajectories of
    `max_tokens` tokens each (the model's context), twice over, and never under 1 MiB."""
    return max(1 << 20, FRAME_HEADROOM * group_size * (max_tokens * _TOKEN_BYTES + _TRAJECTORY_BYTES))


def readable_group(payload: Any) -> tuple[int, list[str], list[Any]] | None:
    """What can be read of a GROUP that does not parse: (its trajectories, their ids, their prompt positions),
    or None when not even its trajectories can be counted. The ids and positions are for the ledger."""
    try:
        body = decode(payload)
    except WireFormatError:
        return None
    wires = body.get("trajectories") if isinstance(body, dict) else None
    if not isinstance(wires, list) or not wires:
        return None
    ids, prompts = [], []
    for w in wires:
        tid = w.get("id") if isinstance(w, dict) else None
        if isinstance(tid, str) and 0 < len(tid) <= 200:
            info = w.get("info")
            ids.append(tid)
            prompts.append(prompt_of(info) if isinstance(info, dict) else None)
    return len(wires), ids, prompts


def grant_credits(producers: list[_Producer], free: int, capacity: int) -> set[bytes]:
    """Give `free` room to waiting producers, oldest demand first and a whole group at a time (a
    group that could never fit the queue is skipped: its producer refuses such groups). Raises the
    granted counts in place; returns who got credits."""
    granted: set[bytes] = set()
    for p in sorted((p for p in producers if p.want > p.granted), key=lambda p: p.waiting_since):
        need = p.want - p.granted
        if p.want - p.received > capacity:
            continue
        if need > free:
            break
        p.granted += need
        free -= need
        granted.add(p.identity)
    return granted


def heard_within(producers: list[_Producer], seconds: float, now: float | None = None) -> int:
    """Producers that sent anything in the last `seconds` (a live one heartbeats every heartbeat_s;
    one that died without a goodbye stays registered until peer_timeout_s)."""
    now = time.monotonic() if now is None else now
    return sum(1 for p in producers if now - p.last_seen <= seconds)
