"""The simulated clock: a heap of timed callbacks, run in time order (ties in scheduling order).

    clock = Clock()
    event = clock.after(2.5, fn, arg)      # fn(arg) at now + 2.5 s
    event.cancel()                         # never runs
    clock.run(until=lambda: done)          # until nothing is due or `until()` holds
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from typing import Any


class Event:
    __slots__ = ("time", "fn", "args", "cancelled")

    def __init__(self, time: float, fn: Callable[..., Any], args: tuple):
        self.time, self.fn, self.args, self.cancelled = time, fn, args, False

    def cancel(self) -> None:
        self.cancelled = True


class Clock:
    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, Event]] = []
        self._order = itertools.count()
        self.events_run = 0

    def at(self, time: float, fn: Callable[..., Any], *args: Any) -> Event:
        if time < self.now:
            raise ValueError(f"clock: cannot schedule at {time} before now ({self.now})")
        event = Event(time, fn, args)
        heapq.heappush(self._heap, (time, next(self._order), event))
        return event

    def after(self, delay: float, fn: Callable[..., Any], *args: Any) -> Event:
        return self.at(self.now + max(0.0, delay), fn, *args)

    def run(self, until: Callable[[], bool] = lambda: False, max_events: int = 50_000_000) -> None:
        while self._heap and not until():
            time, _, event = heapq.heappop(self._heap)
            if event.cancelled:
                continue
            self.now = time
            event.fn(*event.args)
            self.events_run += 1
            if self.events_run > max_events:
                raise RuntimeError(f"simulation ran {max_events} events without finishing; is the profile degenerate?")
