"""The trainer under a simulated clock, with the real batching rule and the real staleness filter.

Like `async_rl/trainer/loop.py`: wait for `trainer.batch_size` trajectories (whole groups, the oldest
first: the queue's `take_groups`), keep what the trainer's `split_by_age` keeps at the bound
`train_staleness(cfg)`, train (a batch dropped whole is no step: the rollout side is told to
release it), publish the new version (the trainer is busy meanwhile), then wait again. Work is
measured in seconds at the profile's own speed, so a trainer whose cores change mid-step (shared
cores) finishes when its work is done.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from async_rl.config import Config
from async_rl.sim.clock import Clock, Event
from async_rl.sim.rollout import SimTrajectory
from async_rl.trainer.backends import train_staleness
from async_rl.trainer.trainer import split_by_age
from async_rl.transport.batching import take_groups


@dataclass
class StepRecord:
    end_s: float  # when the step's version was published
    kept: int
    dropped: int  # over-stale (or from the future)
    tokens: int  # prompt + response tokens trained
    wait_s: float  # waited for the batch
    hist: list[int] = field(default_factory=list)  # arrivals by lag of the oldest token, last bin > eta
    interrupted: int = 0
    engine_busy_s: float = 0.0  # all servers' busy seconds so far (idle fractions over a window)
    buffered: int = 0  # trajectories ready when the trainer asked for this batch (rollout.pace reads it)


class _Work:
    """`seconds` of work at speed 1, done at `speed()` (re-read on `replan`), then `done()`."""

    def __init__(self, clock: Clock, seconds: float, speed: Callable[[], float], done: Callable[[], None]):
        self.clock, self.left, self.speed_fn, self.done = clock, seconds, speed, done
        self.since, self.speed = clock.now, speed()
        self.event: Event = clock.after(self.left / self.speed, self._finish)

    def replan(self) -> None:
        now = self.clock.now
        self.left -= (now - self.since) * self.speed
        self.since, self.speed = now, self.speed_fn()
        self.event.cancel()
        self.event = self.clock.after(max(0.0, self.left) / self.speed, self._finish)

    def _finish(self) -> None:
        self.done()


class SimTrainer:
    def __init__(self, cfg: Config, clock: Clock, step_s: Callable[[int], float], publish_s: float,
                 speed: Callable[[], float], on_busy: Callable[[], None], engine_busy: Callable[[], float]):
        self.cfg, self.clock, self.step_s, self.publish_s = cfg, clock, step_s, publish_s
        self.speed, self.on_busy, self.engine_busy = speed, on_busy, engine_busy
        self.eta = train_staleness(cfg)
        self.version = 0
        self.buffer: deque[list[SimTrajectory]] = deque()
        self.buffered = 0
        self.records: list[StepRecord] = []
        self.arrivals = [0] * (self.eta + 2)  # every batch taken, trained or dropped whole, by lag
        self.skipped = 0
        self.busy = False
        self.work: _Work | None = None
        self.rollout = None  # SimRollout: told of new versions and of batches dropped whole
        self._idle_since = 0.0
        self._asked = 0  # trajectories buffered when the trainer last became free to take a batch
        self._current: StepRecord | None = None

    @property
    def finished(self) -> bool:
        return len(self.records) >= self.cfg.total_steps

    def push(self, group: list[SimTrajectory]) -> None:
        self.buffer.append(group)
        self.buffered += len(group)
        self._try_start()

    def _try_start(self) -> None:
        while not self.busy and not self.finished and self.buffered >= self.cfg.trainer.batch_size:
            groups = take_groups(self.buffer, self.cfg.trainer.batch_size)
            trajs = [t for g in groups for t in g]
            self.buffered -= len(trajs)
            kept, stale, future = split_by_age(trajs, self.version, self.eta, self.cfg.trainer.stale_tokens)
            hist = self._hist(trajs)
            self.arrivals = [a + b for a, b in zip(self.arrivals, hist)]
            if not kept:  # no train step: the version stays, the gate stops counting them
                self.skipped += 1
                self.rollout.release(len(stale) + len(future))
                self._asked = self.buffered  # the real trainer asks again, reading what is ready then
                continue
            self._current = StepRecord(
                end_s=0.0, kept=len(kept), dropped=len(stale) + len(future),
                tokens=sum(t.prompt_len + t.response_len for t in kept), wait_s=self.clock.now - self._idle_since,
                hist=hist, interrupted=sum(1 for t in trajs if t.interrupted), buffered=self._asked)
            self._set_busy(True)
            self.work = _Work(self.clock, self.step_s(self._current.tokens), self.speed, self._trained)

    def _hist(self, trajs: list[SimTrajectory]) -> list[int]:
        hist = [0] * (self.eta + 2)
        for t in trajs:
            if t.newest_version() <= self.version:
                hist[min(self.version - t.oldest_version(), self.eta + 1)] += 1
        return hist

    def _trained(self) -> None:
        self.version += 1
        self.work = None
        self.clock.after(self.publish_s, self._published)

    def _published(self) -> None:
        record = self._current
        record.end_s = self.clock.now
        record.engine_busy_s = self.engine_busy()
        self.records.append(record)
        self._idle_since = self.clock.now
        self._set_busy(False)
        self.rollout.weights(self.version)
        self.rollout.pace(record.buffered)
        self._asked = self.buffered
        self._try_start()

    def _set_busy(self, busy: bool) -> None:
        if busy != self.busy:
            self.busy = busy
            self.on_busy()

    def replan(self) -> None:
        if self.work is not None:
            self.work.replan()
