"""The staleness gate: admission control that bounds policy staleness.

With train batch size B (trajectories) and trainer version v, at most (v + eta + 1) * B
trajectories are ever admitted. Since the trainer consumes B per version, any admitted
trajectory is trained at most eta versions after the version it started under; the
trainer still drops (and counts) anything older as a second line of defence.
eta = 0 is synchronous-equivalent on-policy training.

Pacing (`rollout.pace`): when the trainer is the bottleneck, a rollout side allowed eta versions
ahead runs all of them ahead, and every trajectory arrives about eta versions old, which costs
learning and buys no throughput (the trainer is busy anyway). A paced gate admits up to
(v + ahead + 1) * B with 1 <= ahead <= eta, and moves `ahead` by what the trainer saw when it asked
for each batch (`pace`): one version more when it had to wait, one less after it went a whole
pipeline without waiting. eta stays the bound; `ahead` only chooses how much of it is used.

These rules are pure and clock-free, so the rollout controller (under asyncio) and the
simulator (`async_rl/sim`, under a simulated clock) call the same code: `for_config`
(which bound a run uses), `try_admit` (admission) and `stale_attempts` (which generations
went too stale to be trained).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import TypeVar

from async_rl.config import Config

T = TypeVar("T")


class StalenessGate:
    def __init__(self, batch_size: int, max_staleness: int, version: int = 0, pace: bool = False):
        if batch_size <= 0:
            raise ValueError(f"batch_size: must be > 0, got {batch_size}")
        if max_staleness < 0:
            raise ValueError(f"max_staleness: must be >= 0, got {max_staleness}")
        self.batch_size = batch_size
        self.max_staleness = max_staleness
        self.paced = pace
        # versions admitted ahead of the loaded one: eta, paced or not (the pipeline fills first; starting
        # paced runs at 1 cost generation-bound ones up to 5% in the simulator while they climbed)
        self.ahead = max_staleness
        self._fed = 0  # asks in a row that found a batch ready (pacing)
        self.version = version
        self.admitted = 0
        self._changed = asyncio.Event()

    @classmethod
    def for_config(cls, cfg: Config) -> "StalenessGate":
        """The gate of a run: sync mode takes turns (eta 0), async allows `max_staleness`."""
        if cfg.mode == "sync":
            return cls(cfg.trainer.batch_size, 0)
        return cls(cfg.trainer.batch_size, cfg.max_staleness, pace=cfg.rollout.pace)

    @property
    def limit(self) -> int:
        """Most trajectories that may have been admitted at the current version."""
        return (self.version + self.ahead + 1) * self.batch_size

    def pace(self, buffered: int) -> None:
        """The trainer found `buffered` trajectories ready when it asked for its last batch. Fewer than
        B: it waited, so run one version more ahead (up to eta). One version less (down to 1) when
        more than `ahead` asks in a row found a batch ready and this one found a batch to spare (2 B):
        a pipeline's worth of steps without a wait, so a burst of batches finishing together (which
        a generation-bound run waits for every `ahead + 1` steps) does not read as a surplus. A gate
        built without pacing ignores this."""
        if not self.paced:
            return
        if buffered < self.batch_size:
            self._fed = 0
            if self.ahead < self.max_staleness:
                self.ahead += 1
                self._changed.set()
            return
        self._fed += 1
        if self._fed > self.ahead and buffered >= 2 * self.batch_size and self.ahead > min(1, self.max_staleness):
            self.ahead -= 1  # and the next ask may take one more off: the pipeline has been calm

    def can_admit(self, k: int) -> bool:
        return self.admitted + k <= self.limit

    def admit(self, k: int) -> None:
        if not self.can_admit(k):
            raise RuntimeError(f"staleness gate: admitting {k} would exceed {self.limit} at version {self.version}")
        self.admitted += k

    def join(self, admitted: int) -> None:
        """Start from the trainer's accounting (a side that joins a run in progress): `admitted`
        trajectories are already counted. New prompts wait until the weights of the trainer's
        version are loaded (`set_version`), so nothing is generated that is stale on arrival."""
        if admitted > self.admitted:
            self.admitted = admitted
            self._changed.set()

    def release(self, n: int) -> None:
        """The trainer dropped `n` admitted trajectories without spending a version on them: they
        no longer count against the bound (otherwise admission would stall)."""
        self.admitted = max(0, self.admitted - n)
        self._changed.set()

    def set_version(self, version: int) -> None:
        """The rollout side now samples with `version`; versions only move forward."""
        if version > self.version:
            self.version = version
            self._changed.set()

    def try_admit(self, k: int) -> bool:
        """Admit `k` more trajectories if they fit under the bound now; ValueError if they never can."""
        if k > (self.max_staleness + 1) * self.batch_size:
            raise ValueError(f"a unit of {k} trajectories can never fit under the staleness bound "
                             f"(eta + 1) * B = {(self.max_staleness + 1) * self.batch_size}")
        if not self.can_admit(k):
            return False
        self.admit(k)
        return True

    async def wait_admit(self, k: int) -> None:
        """Wait until `k` more trajectories fit under the bound, then admit them."""
        while not self.try_admit(k):
            self._changed.clear()
            await self._changed.wait()

    def stale_attempts(self, started: Mapping[T, int], version: int) -> list[T]:
        """Of generations in flight (each -> the version it started under), those begun more than
        max_staleness versions before `version`: once `version` is loaded they can no longer be
        trained (the trainer is at `version` or later and drops them)."""
        return [a for a, v in started.items() if version - v > self.max_staleness]

    def stats(self) -> dict[str, float]:
        return {"rollout/admitted": self.admitted, "rollout/gate_limit": self.limit,
                "rollout/version": self.version, "rollout/ahead": self.ahead}
