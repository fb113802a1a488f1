"""The trainer's drain flag: SIGTERM finishes the current step, checkpoints and stops.

    drain = Drain.install()                      # in the trainer process: SIGTERM sets a flag instead of interrupting
    if drain.requested: ...                      # checked between steps; drain.check() while waiting for a batch

The launcher (async_rl/launch/local.py) sends SIGTERM to stop a run early; the trainer loop
(async_rl/trainer/loop.py) reads the flag so that nothing it consumed goes uncommitted.
"""

from __future__ import annotations

import logging
import signal
import threading

logger = logging.getLogger(__name__)


class DrainRequested(Exception):
    """SIGTERM arrived while the trainer waited for a batch (raised by `Drain.check`)."""


class Drain:
    """A SIGTERM flag for the trainer process: the training loop finishes its step, checkpoints and
    stops when it is set, instead of being interrupted mid-step (see async_rl/launch/local.py, drain).

        drain = Drain.install()
        while step < total_steps and not drain.requested:
            groups = wait_batch(on_tick=drain.check)   # DrainRequested: stop waiting, nothing to finish
            ...                                        # one train step
        checkpoint(step)
    """

    def __init__(self) -> None:
        self._event = threading.Event()

    @classmethod
    def install(cls) -> "Drain":
        """A new flag that SIGTERM sets in this process (call from the main thread)."""
        return cls().listen()

    def listen(self) -> "Drain":
        """Handle SIGTERM in this process (the main thread) by setting this flag."""
        signal.signal(signal.SIGTERM, self._on_signal)
        return self

    def _on_signal(self, signum, frame) -> None:
        if not self._event.is_set():
            logger.warning("SIGTERM: finishing the current step, then checkpointing and stopping")
        self._event.set()

    def request(self) -> None:
        self._event.set()

    @property
    def requested(self) -> bool:
        return self._event.is_set()

    def check(self) -> None:
        if self._event.is_set():
            raise DrainRequested
