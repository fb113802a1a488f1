"""What the trainer consumed, and when that becomes durable: checkpoints commit consumption.

    policy = CheckpointPolicy(every=0, budget=0.05)
    book = Consumption(ledger, queue, prompts)      # prompts: positions a resume restored
    book.consume(step, kept, stale, future)         # after a train step (ledger + room freed)
    book.filtered(step, trajs)                      # dynamic sampling set them aside for step's batch
    if policy.due(step + 1): save(); book.commit(step + 1)

A trajectory the trainer consumed (trained, dropped as over-stale or as sampled by newer
weights than the trainer's, or filtered by dynamic sampling) frees its room in the queue at
once, but its producer is told only at the next checkpoint (`commit`): until then the
rollout side keeps it in its outbox, so a trainer that crashes and resumes from that
checkpoint gets it sent again and trains it again, in the history of the final weights
exactly once. The checkpoint policy keeps this cheap: a checkpoint is due once the time
since the last one reaches its measured cost divided by `trainer.checkpoint_budget` (5%: a
checkpoint taking 3 s comes every minute, a tiny model's every step), and every
`trainer.checkpoint_every` steps where that is set.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from async_rl.transport.queue import TrajectoryQueueServer
from async_rl.types import Trajectory
from async_rl.utils.ledger import Ledger
from async_rl.utils.prompts import PromptSet, prompt_of


class CheckpointPolicy:
    """When the next checkpoint is due: every `every` steps, and whenever the time since the last
    one reaches its cost / `budget` (the first, with no cost measured yet, after the first step)."""

    def __init__(self, every: int, budget: float, clock: Callable[[], float] = time.monotonic):
        self.every, self.budget, self.clock = every, budget, clock
        self.cost: float | None = None  # seconds the last checkpoint took
        self.last = clock()

    def due(self, steps_done: int) -> bool:
        if self.every and steps_done % self.every == 0:
            return True
        if self.budget <= 0:
            return False
        return self.cost is None or self.clock() - self.last >= self.cost / self.budget

    def done(self, cost_s: float) -> None:
        self.cost, self.last = cost_s, self.clock()


class Consumption:
    """The trainer's book of consumed trajectories: ledger events, the positions of the prompt
    stream consumed (told to sides that join), and what the next commit acknowledges."""

    def __init__(self, ledger: Ledger, queue: TrajectoryQueueServer, prompts: PromptSet | None = None):
        self.ledger, self.queue = ledger, queue
        self.prompts = prompts.copy() if prompts is not None else PromptSet()
        self.uncommitted: list[str] = []

    def consume(self, step: int, kept: list[Trajectory], stale: list[Trajectory], future: list[Trajectory]) -> None:
        """A batch went through step `step`: record what became of each trajectory, free its room."""
        for event, trajs in (("trained", kept), ("dropped_stale", stale), ("dropped_future", future)):
            self._record(event, step, trajs)

    def filtered(self, step: int, trajs: list[Trajectory]) -> None:
        """Groups without reward variance, set aside while step `step`'s batch was filled: consumed."""
        self._record("filtered", step, trajs)

    def _record(self, event: str, step: int, trajs: list[Trajectory]) -> None:
        if not trajs:
            return
        self.ledger.record(event, [t.id for t in trajs], prompts=[prompt_of(t.info) for t in trajs], step=step)
        self.prompts.update(q for t in trajs if (q := prompt_of(t.info)) is not None)
        ids = [t.id for t in trajs]
        self.queue.ack(ids, commit=False)
        self.uncommitted += ids

    def commit(self, step: int) -> None:
        """A checkpoint of step `step` is on disk: everything consumed before it is durable."""
        self.ledger.record("committed", step=step)
        if self.uncommitted:
            self.queue.commit(self.uncommitted)
        self.uncommitted = []
