"""Publishing weight versions, and replaying the current one to a rollout side that joins late.

    versions = VersionReplay(queue, publisher, trainer)
    stats = versions.publish()      # after a train step: sync/ metrics
    versions.check()                # while waiting for a batch: a side that joined gets the current weights

`publish_weights` is the one call that sends a version: through `weight_sync.transport`
(disk | zmq | dist), then a control message that tells the rollout side.
"""

from __future__ import annotations

import logging
from typing import Any

from async_rl.protocols import WeightPublisher
from async_rl.transport.queue import TrajectoryQueueServer

logger = logging.getLogger(__name__)


def publish_weights(publisher: WeightPublisher, queue: TrajectoryQueueServer, weights: Any,
                    version: int) -> dict[str, float]:
    """Publish one version through `weight_sync.transport` and tell the rollout side; return sync/ metrics.
    `weights`: `trainer.weights()`, read from the parameters bucket by bucket (no copy of the model).
    Raises (the old weights stay in use everywhere) when the transport fails or misses its deadline."""
    msg = publisher.publish(weights, version)
    if msg is not None:  # dist announces the version itself, before its collective
        queue.broadcast(msg)
    return dict(getattr(publisher, "stats", {}))


class VersionReplay:
    """Publishes each version, and replays the current one when a rollout side joins (or re-joins) a run
    in progress after it was published, so that side generates with the trainer's policy at once (its
    gate waits for them; see StalenessGate.join). A side connected when a version was published got it:
    no replay for it (with `dist` a replay is a collective every server takes part in, not a broadcast
    that a side holding the version may ignore)."""

    def __init__(self, queue: TrajectoryQueueServer, publisher: WeightPublisher, trainer) -> None:
        self.queue, self.publisher, self.trainer = queue, publisher, trainer
        self.sessions = 0  # sessions connected at the last publish (or seen by the last check)

    def publish(self) -> dict[str, float]:
        """Publish the trainer's current version; return its sync/ metrics."""
        sessions = self.queue.stats().get("queue/sessions", 0)  # before: one that connects meanwhile is replayed to
        stats = publish_weights(self.publisher, self.queue, self.trainer.weights(), self.trainer.policy_version)
        self.sessions = max(self.sessions, sessions)
        return stats

    def check(self) -> None:
        sessions = self.queue.stats().get("queue/sessions", 0)
        if sessions <= self.sessions:
            return
        if self.trainer.policy_version == 0:
            self.sessions = sessions
            return  # a side that joins at the start already holds version 0
        logger.info("a rollout side joined at version %d: publishing the current weights again",
                    self.trainer.policy_version)
        self.publish()
