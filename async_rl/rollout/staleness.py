"""The staleness gate: admission control that bounds policy staleness.

With train batch size B (trajectories) and trainer version v, at most (v + eta + 1) * B
trajectories are ever admitted. Since the trainer consumes B per version, any admitted
trajectory is trained at most eta versions after the version it started under; the
trainer still drops (and counts) anything older as a second line of defence.
eta = 0 is synchronous-equivalent on-policy training.

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
    def __init__(self, batch_size: int, max_staleness: int, version: int = 0):
        if batch_size <= 0:
            raise ValueError(f"batch_size: must be > 0, got {batch_size}")
        if max_staleness < 0:
            raise ValueError(f"max_staleness: must be >= 0, got {max_staleness}")
        self.batch_size = batch_size
        self.max_staleness = max_staleness
        self.version = version
        self.admitted = 0
        self._changed = asyncio.Event()

    @classmethod
    def for_config(cls, cfg: Config) -> "StalenessGate":
        """The gate of a run: sync mode takes turns (eta 0), async allows `max_staleness`."""
        return cls(cfg.trainer.batch_size, 0 if cfg.mode == "sync" else cfg.max_staleness)

    @property
    def limit(self) -> int:
        """Most trajectories that may have been admitted at the current version."""
        return (self.version + self.max_staleness + 1) * self.batch_size

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
                "rollout/version": self.version}
