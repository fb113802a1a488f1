"""The rollout side under a simulated clock, driving the real admission and staleness rules.

It does what `RolloutController` does, in the same order, calling the same code:
- admission: one group of `rollout.group_size` per prompt position, in stream order, while the
  real `StalenessGate.try_admit` lets it (the gate built by `StalenessGate.for_config`), its fill
  ramp read again whenever a trajectory finishes (`gate.ramp`, as `wait_admit` does);
- `rollout.max_concurrent` slots, taken first come first served (the controller's semaphore);
  each attempt goes to the server with the fewest requests in flight (the pool's rule);
- a weight update pauses every server, loads, continues, then `gate.set_version`, and, with
  `rollout.restart_stale`, restarts what `gate.stale_attempts` names (the slot and the gate's
  count stay; the sample keeps its length: same prompt, same seed);
- a finished group goes to the trainer; a batch the trainer drops whole comes back as `release`;
  with `rollout.pace`, what the trainer found ready at each batch comes back as `gate.pace`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from async_rl.config import Config
from async_rl.rollout.staleness import StalenessGate
from async_rl.sim.clock import Clock
from async_rl.sim.profile import SyncProfile
from async_rl.sim.server import Seq, SimServer


class SimTrajectory:
    """What the trainer's filter reads of a trajectory (the same methods as `Trajectory`)."""

    __slots__ = ("oldest", "newest", "prompt_len", "response_len", "interrupted")

    def __init__(self, seq: Seq):
        self.oldest, self.newest = seq.first_version, seq.last_version
        self.prompt_len, self.response_len, self.interrupted = seq.prompt, seq.target, seq.interrupted

    def oldest_version(self) -> int:
        return self.oldest

    def newest_version(self) -> int:
        return self.newest

    def within_bound(self, floor: int) -> "SimTrajectory":
        """trainer.stale_tokens=mask: its tokens before `floor` leave the loss (they are still computed)."""
        out = object.__new__(SimTrajectory)
        out.oldest, out.newest = floor, self.newest
        out.prompt_len, out.response_len, out.interrupted = self.prompt_len, self.response_len, self.interrupted
        return out


class _Sample:
    __slots__ = ("group", "prompt", "length", "result")

    def __init__(self, group: "_Group", prompt: int, length: int):
        self.group, self.prompt, self.length = group, prompt, length
        self.result: SimTrajectory | None = None


class _Group:
    __slots__ = ("position", "samples", "left")

    def __init__(self, position: int):
        self.position, self.samples, self.left = position, [], 0


class SimRollout:
    def __init__(self, cfg: Config, clock: Clock, servers: list[SimServer], sync: SyncProfile,
                 draw_length: Callable[[], int], prompt_len: int, push: Callable[[list[SimTrajectory]], None]):
        self.cfg, self.clock, self.servers, self.sync = cfg, clock, servers, sync
        self.draw_length, self.prompt_len, self.push = draw_length, prompt_len, push
        self.gate = StalenessGate.for_config(cfg)
        self.free_slots = cfg.rollout.max_concurrent
        self._slot_queue: deque[_Sample] = deque()
        self.attempts: dict[Seq, int] = {}  # in flight -> the version it started under
        self.position = 0
        self.restarted = 0
        self._updates: deque[int] = deque()
        self._updating = False
        self._cursor = -1
        for server in servers:
            server.on_finish = self._finished

    # ------------------------------------------------------------------ admission
    def admit(self) -> None:
        n = self.cfg.rollout.group_size
        while True:
            if not self.gate.try_admit(n):
                if self.gate.ramp(len(self.attempts) + len(self._slot_queue)):
                    continue
                return
            group = _Group(self.position)
            self.position += 1
            group.samples = [_Sample(group, self.prompt_len, self.draw_length()) for _ in range(n)]
            group.left = n
            for sample in group.samples:
                if self.free_slots > 0:
                    self.free_slots -= 1
                    self._start(sample)
                else:
                    self._slot_queue.append(sample)

    def _start(self, sample: _Sample) -> None:
        seq = Seq(sample, sample.prompt, sample.length)
        self.attempts[seq] = self.gate.version
        self._least_loaded().add(seq)

    def _least_loaded(self) -> SimServer:
        n = len(self.servers)
        best = min(self.servers, key=lambda s: (s.in_flight, (s.index - self._cursor - 1) % n))
        self._cursor = best.index
        return best

    def _finished(self, seq: Seq) -> None:
        self.attempts.pop(seq, None)
        sample: _Sample = seq.owner
        sample.result = SimTrajectory(seq)
        if self._slot_queue:
            self._start(self._slot_queue.popleft())
        else:
            self.free_slots += 1
        group = sample.group
        group.left -= 1
        if group.left == 0:
            self.push([s.result for s in group.samples])
        self.admit()  # the fill ramp may admit more now

    def release(self, n: int) -> None:
        """The trainer dropped `n` admitted trajectories without a train step."""
        self.gate.release(n)
        self.admit()

    def pace(self, buffered: int) -> None:
        """The trainer found `buffered` trajectories ready when it asked for its last batch (rollout.pace)."""
        self.gate.pace(buffered)
        self.admit()

    # ------------------------------------------------------------------ weight updates
    def weights(self, version: int) -> None:
        """The trainer published `version`: updates are applied one at a time, in order."""
        self._updates.append(version)
        self._next_update()

    def _next_update(self) -> None:
        if self._updating or not self._updates:
            return
        self._updating = True
        version = self._updates.popleft()
        left = [len(self.servers)]

        def loaded(server: SimServer) -> None:
            server.commit(version, self.sync.recompute)
            server.resume()
            left[0] -= 1
            if left[0] == 0:
                self._updating = False
                self._loaded(version)
                self._next_update()

        for server in self.servers:
            server.pause(lambda s=server: self.clock.after(self.sync.load_s, loaded, s))

    def _loaded(self, version: int) -> None:
        self.gate.set_version(version)
        if self.cfg.rollout.restart_stale:
            for seq in self.gate.stale_attempts(self.attempts, version):
                del self.attempts[seq]
                seq.server.abort(seq)
                self.restarted += 1
                self._start(seq.owner)
        self.admit()
