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

The fill ramp (`rollout.fill_ramp`): a pipeline admitted eta + 1 batches deep at once starts them all
together, and each decode step of an engine whose step time grows with its batch (a CPU, a GPU past
its flat region) then serves all of them, so the first batch, which the trainer is waiting for, takes
up to eta + 1 times longer to finish. A ramping gate starts one batch deep (`ahead` = 0) and goes one
version deeper whenever fewer than `fill_ramp * B` admitted trajectories are still generating (the
batches before are in their long tail, where more sequences cost a step little); once the first new
version is loaded (the first batch is trained) it goes to its full depth, eta, at once, as an
unramped gate starts. 0 admits all eta + 1 batches at once.

These rules are pure and clock-free, so the rollout controller (under asyncio) and the
simulator (`async_rl/sim`, under a simulated clock) call the same code: `for_config`
(which bound a run uses), `try_admit` (admission) and `stale_attempts` (which generations
went too stale to be trained).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from typing import TypeVar

from async_rl.config import Config

T = TypeVar("T")


class StalenessGate:
    def __init__(self, batch_size: int, max_staleness: int, version: int = 0, pace: bool = False,
                 fill_ramp: float = 0.0):
        if batch_size <= 0:
            raise ValueError(f"batch_size: must be > 0, got {batch_size}")
        if max_staleness < 0:
            raise ValueError(f"max_staleness: must be >= 0, got {max_staleness}")
        self.batch_size = batch_size
        self.max_staleness = max_staleness
        if fill_ramp < 0:
            raise ValueError(f"fill_ramp: must be >= 0, got {fill_ramp}")
        self.paced = pace
        self.fill_ramp = fill_ramp
        # versions admitted ahead of the loaded one: eta, paced or not, once the pipeline is full (starting
        # paced runs at 1 cost generation-bound ones up to 5% in the simulator while they climbed); a
        # ramping gate climbs there from 0 as the batches before finish (`ramp`)
        self.ahead = 0 if fill_ramp > 0 else max_staleness
        self._ramping = fill_ramp > 0 and max_staleness > 0
        self._fed = 0  # asks in a row that found a batch ready (pacing)
        self.version = version
        self.admitted = 0
        self._changed = asyncio.Event()

    @classmethod
    def for_config(cls, cfg: Config) -> "StalenessGate":
        """The gate of a run: sync mode takes turns (eta 0), async allows `max_staleness`."""
        if cfg.mode == "sync":
            return cls(cfg.trainer.batch_size, 0)
        return cls(cfg.trainer.batch_size, cfg.max_staleness, pace=cfg.rollout.pace, fill_ramp=cfg.rollout.fill_ramp)

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
        self._end_ramp()
        if buffered < self.batch_size:
            self._fed = 0
            if self.ahead < self.max_staleness:
                self.ahead += 1
                self._changed.set()
            return
        self._fed += 1
        if self._fed > self.ahead and buffered >= 2 * self.batch_size and self.ahead > min(1, self.max_staleness):
            self.ahead -= 1  # and the next ask may take one more off: the pipeline has been calm

    def ramp(self, generating: int) -> bool:
        """While the pipeline fills (before the first version after the start is loaded): `generating`
        admitted trajectories are not finished yet; fewer than `fill_ramp * B` of them deepen the
        pipeline by one version (True)."""
        if not self._ramping or self.ahead >= self.max_staleness or generating >= self.fill_ramp * self.batch_size:
            return False
        self.ahead += 1
        self._changed.set()
        return True

    def _end_ramp(self) -> None:
        """The fill is over (the first batch is trained): the pipeline goes to its full depth, from where
        pacing, if on, moves it."""
        if self._ramping:
            self._ramping = False
            self.ahead = self.max_staleness
            self._changed.set()

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
            self._end_ramp()
            self._changed.set()

    def notify(self) -> None:
        """Something a waiting `wait_admit` reads changed (a generation finished: `ramp` may allow more)."""
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

    async def wait_admit(self, k: int, generating: Callable[[], int] = lambda: 0) -> None:
        """Wait until `k` more trajectories fit under the bound, then admit them. `generating()`: how many
        admitted trajectories are still generating (for `ramp`; the caller `notify`s when one finishes)."""
        while not self.try_admit(k):
            if self.ramp(generating()):
                continue
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
