"""Processes of one machine lend each other their CPU cores while they wait.

On a CPU box the trainer and the generation servers share the same cores. A fixed split
(half each) wastes the half of whichever side is waiting: generation blocked at the
staleness gate, or the trainer waiting for a batch. Here every process has a base
`share` of the cores and marks itself busy or idle in a small shared file (one slot
per process, a memory-mapped byte array); before each unit of work it takes its share
plus the share of every process that is idle right now:

    share = CoreShare.claim("runs/x/.cores", share=1)   # this process, with a base of 1 core
    share.busy()                 # before work: also sets torch threads to what is free
    ...                          # forward passes, backward passes
    share.idle()                 # while waiting: lend our cores

`refresh()` re-reads the file and changes torch's thread count only when the answer
changed; callers run it at fine-grained points (every engine step, every decoder
layer of the trainer's forward) so a side that becomes idle is noticed within
milliseconds. A process that dies leaves its slot busy at worst, which only falls back
to the fixed split until a liveness check (once a second) sees its pid is gone. Pools on
separate machines (GPUs) never share a file.
"""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
import struct
import time
from pathlib import Path

import torch

from async_rl.utils.pids import pid_alive

logger = logging.getLogger(__name__)

SLOTS = 64  # processes that can share one machine's cores
_FIELDS = 6  # per slot: state (0 = absent, 1 = idle, 2 = busy), share, pid (4 bytes, little endian)
_ABSENT, _IDLE, _BUSY = 0, 1, 2


def base_share(configured: int, mode: str, cores: int) -> int:
    """Cores one process of a machine with `cores` takes as its own: as configured, else half of
    them when rollout and trainer run at once (async), all of them when they take turns (sync).
    The simulator (async_rl/sim) shares its simulated cores by the same rule."""
    if configured > 0:
        return configured
    return cores if mode == "sync" else max(1, cores // 2)


def lent(share: int, total: int, busy_shares: list[int]) -> int:
    """Cores a process with base `share` may use now: all that the busy others' shares leave, at least its own."""
    return max(share, total - sum(busy_shares))


class CoreShare:
    def __init__(self, path: str | os.PathLike, slot: int, share: int, total: int | None = None):
        if not 0 <= slot < SLOTS:
            raise ValueError(f"core share slot: must be in [0, {SLOTS}), got {slot}")
        self.total = total or len(os.sched_getaffinity(0))
        self.share = max(1, min(share, self.total))
        self.slot = slot
        self._map = _open_map(Path(path))
        self._threads = 0
        self._thread_s = 0.0  # integral of this process's torch threads over time (timings per core count)
        self._since = time.perf_counter()
        self._dead: set[int] = set()
        self._checked = 0.0
        base = slot * _FIELDS
        self._map[base + 1] = self.share
        self._map[base + 2:base + 6] = struct.pack("<I", os.getpid())
        self._set(_BUSY)

    @classmethod
    def claim(cls, path: str | os.PathLike, share: int, total: int | None = None) -> "CoreShare":
        """Join the share in the first free slot (slots of processes that are gone are reused)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(str(path) + ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            mm = _open_map(path)
            try:
                for slot in range(SLOTS):
                    base = slot * _FIELDS
                    pid = struct.unpack("<I", mm[base + 2:base + 6])[0]
                    if mm[base] == _ABSENT or not pid_alive(pid):
                        return cls(path, slot, share, total)
            finally:
                mm.close()
        raise RuntimeError(f"{path}: all {SLOTS} core-share slots are taken")

    def _set(self, state: int) -> None:
        self._map[self.slot * _FIELDS] = state

    def lent_to_me(self) -> int:
        """Cores this process may use now: its share plus the shares of idle processes."""
        raw = self._map[:]
        busy = [s for s in range(SLOTS) if s != self.slot and raw[s * _FIELDS] == _BUSY]
        now = time.monotonic()
        if now - self._checked > 1.0:  # a process killed while busy must not hold its cores forever
            self._checked = now
            self._dead = {s for s in busy if not pid_alive(struct.unpack("<I", raw[s * _FIELDS + 2:s * _FIELDS + 6])[0])}
        return lent(self.share, self.total, [raw[s * _FIELDS + 1] for s in busy if s not in self._dead])

    def refresh(self) -> int:
        """Set torch's intra-op threads to what is free now (only when it changed); return it."""
        n = self.lent_to_me()
        if n != self._threads:
            self.thread_seconds()
            torch.set_num_threads(n)
            self._threads = n
        return n

    def thread_seconds(self) -> float:
        """Thread-seconds this process has run with so far: the difference over a span divided by the
        span is its mean core count then (a calibration of the simulator needs it: async_rl/sim)."""
        now = time.perf_counter()
        self._thread_s += self._threads * (now - self._since)
        self._since = now
        return self._thread_s

    def busy(self) -> int:
        self._set(_BUSY)
        return self.refresh()

    def idle(self) -> None:
        self._set(_IDLE)

    def leave(self) -> None:
        self._set(_ABSENT)
        self._map.close()


def _open_map(path: Path) -> mmap.mmap:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        if os.fstat(fd).st_size < SLOTS * _FIELDS:
            os.ftruncate(fd, SLOTS * _FIELDS)
        return mmap.mmap(fd, SLOTS * _FIELDS)
    finally:
        os.close(fd)


def refresh_per_layer(model: torch.nn.Module, share: CoreShare) -> None:
    """Re-check the core share before every decoder layer's forward and before its backward.

    The backward needs its own check: torch keeps the thread count the last forward layer set, and
    the backward is two thirds of a train step. In an async run on shared cores the engine tends to
    be busy when a step starts (new weights, a new batch to generate) and to go idle at the staleness
    gate while the trainer is in its backward: a forward-only check never saw that, and the trainer
    ran on its own share while the other cores waited (frozen shared async vs sync at eta=2, 3 rounds:
    1.19x without this check, 1.47x with it; the demo: no measurable change). The backward check is
    a hook on each layer's output, which autograd runs as that output's gradient arrives; it leaves
    the gradient as it is."""
    def before_forward(module: torch.nn.Module, args: tuple) -> None:  # a pre-hook that returns None keeps the inputs
        share.refresh()

    def before_backward(grad: torch.Tensor) -> None:  # a tensor hook that returns None keeps the gradient
        share.refresh()

    def after_forward(module: torch.nn.Module, args: tuple, output) -> None:
        out = output[0] if isinstance(output, (tuple, list)) else output
        if isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(before_backward)

    layers = getattr(getattr(model, "model", None), "layers", None) or [model]
    for layer in layers:
        layer.register_forward_pre_hook(before_forward)
        layer.register_forward_hook(after_forward)
