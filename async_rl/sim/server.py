"""One simulated generation server: continuous batching, paused and reloaded by weight updates.

A step decodes one token for every fully computed running sequence and spends what is left of
`max_tokens_per_step` on prompt / KV-recompute tokens (oldest first); a sequence whose prefill
completes samples its next token in that step, as the embedded engine's scheduler does. A stretch
of pure decode steps is one event: its length follows in closed form from the profile (each step
attends to one more token per sequence), and it is cut at the next step boundary whenever
something happens (a request arrives or is aborted, a pause, a change of speed).

Versions: a token carries the version the server holds when it is sampled; a weight update
(`pause` -> `commit` -> `resume`) marks every running sequence interrupted and, with
`recompute`, makes it compute its KV again before it samples again.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Callable

from async_rl.sim.clock import Clock, Event
from async_rl.sim.profile import EngineProfile

WAITING, PREFILL, DECODE, DONE = range(4)


class Seq:
    """One generation request: `target` response tokens after a `prompt`-token prompt."""

    __slots__ = ("owner", "prompt", "target", "generated", "prefill_left", "join_step", "gen_at_join",
                 "first_version", "last_version", "interrupted", "cancelled", "state", "no", "server")

    def __init__(self, owner: object, prompt: int, target: int):
        self.owner, self.prompt, self.target = owner, prompt, target
        self.generated = self.prefill_left = self.join_step = self.gen_at_join = 0
        self.first_version: int | None = None
        self.last_version = 0
        self.interrupted = self.cancelled = False
        self.state = WAITING
        self.no = 0
        self.server: SimServer | None = None


class SimServer:
    def __init__(self, index: int, profile: EngineProfile, clock: Clock, speed: Callable[[], float],
                 on_finish: Callable[[Seq], None], on_busy: Callable[["SimServer"], None] = lambda s: None):
        self.index, self.profile, self.clock = index, profile, clock
        self.speed, self.on_finish, self.on_busy = speed, on_finish, on_busy
        self.version = 0
        self.in_flight = 0  # requests added and not finished or aborted (load balancing)
        self.waiting: deque[Seq] = deque()
        self.prefill: deque[Seq] = deque()
        self._heap: list[tuple[int, int, Seq]] = []  # decoding: (step it finishes at, no, seq)
        self.n_dec = 0
        self.ctx_sum = 0  # context of the decoding sequences at the current step boundary
        self.steps = 0
        self.paused = False
        self._pause_waiters: list[Callable[[], None]] = []
        self._event: Event | None = None
        self._run: tuple[float, int, float, float] | None = None  # decode run: start, steps, c1, c2
        self._aborted: list[Seq] = []
        self._in_boundary = False
        self._added = 0
        self.busy = False
        self.busy_s = 0.0
        self._busy_since = 0.0

    # ------------------------------------------------------------------ requests and updates
    def add(self, seq: Seq) -> None:
        self._added += 1
        seq.no, seq.state, seq.server = self._added, WAITING, self
        self.in_flight += 1
        self.waiting.append(seq)
        self.poke()

    def abort(self, seq: Seq) -> None:
        if seq.state == DONE or seq.cancelled:
            return
        seq.cancelled = True
        self.in_flight -= 1
        self._aborted.append(seq)
        self.poke()

    def pause(self, then: Callable[[], None]) -> None:
        """Stop at the next step boundary, then call `then` (the server stays paused until `resume`)."""
        self._pause_waiters.append(then)
        self.poke()

    def commit(self, version: int, recompute: bool) -> None:
        """The weights of `version` are loaded (while paused): every running sequence is interrupted."""
        self.version = version
        running = list(self.prefill)
        for _, _, seq in self._heap:
            if seq.state == DECODE and not seq.cancelled:
                seq.generated = seq.gen_at_join + self.steps - seq.join_step
                running.append(seq)
        for seq in running:
            seq.interrupted = True
        if not recompute:
            return
        self._heap, self.n_dec, self.ctx_sum = [], 0, 0
        running.sort(key=lambda s: s.no)
        for seq in running:
            seq.state, seq.prefill_left = PREFILL, seq.prompt + seq.generated
        self.prefill = deque(running)

    def resume(self) -> None:
        self.paused = False
        self.poke()

    @property
    def running(self) -> int:
        return len(self.prefill) + self.n_dec

    # ------------------------------------------------------------------ the step loop
    def poke(self) -> None:
        """Something changed: an idle server looks at its work now; a decode run stops at its next boundary."""
        if self._in_boundary:
            return
        if self._event is None:  # at zero delay: whatever else arrives at this instant joins the same step
            self._event = self.clock.after(0.0, self._wake)
        elif self._run is not None:
            self._cut_run()

    def _wake(self) -> None:
        self._event = None
        self._boundary()

    def _boundary(self) -> None:
        self._in_boundary = True
        try:
            self._purge()
            if self._pause_waiters:
                self.paused = True
                waiters, self._pause_waiters = self._pause_waiters, []
                for then in waiters:
                    then()
            if self.paused:
                self._set_busy(False)
                return
            taken = 0
            while self.waiting and self.running < self.profile.max_running:
                seq = self.waiting.popleft()
                seq.state, seq.prefill_left = PREFILL, seq.prompt + seq.generated
                self.prefill.append(seq)
                taken += 1
            if not self.prefill and not self.n_dec:
                self._set_busy(False)
                return
            self._set_busy(True)
            if self.prefill:
                self._mixed_step(taken)
            else:
                self._decode_run()
        finally:
            self._in_boundary = False

    def _mixed_step(self, taken: int) -> None:
        """One step of decodes and prompt / recompute chunks; `taken`: the requests it takes in (each costs
        the profile's per_request_s)."""
        budget = max(1, self.profile.max_tokens_per_step - self.n_dec)
        chunks: list[tuple[Seq, int]] = []
        tokens = completing = ctx = 0
        for seq in self.prefill:
            take = min(seq.prefill_left, budget - tokens)
            if take <= 0:
                break
            chunks.append((seq, take))
            tokens += take
            if take == seq.prefill_left:
                completing += 1
                ctx += seq.prompt + seq.generated
        seconds = (self.profile.step_s(self.n_dec + completing, self.ctx_sum + ctx, tokens, self.speed())
                   + taken * self.profile.per_request_s)  # Python's work: one core whatever the server has
        self._event = self.clock.after(seconds, self._end_mixed, chunks, completing)

    def _end_mixed(self, chunks: list[tuple[Seq, int]], completing: int) -> None:
        self._event = None
        self._in_boundary = True  # callbacks of finished requests may add or abort: seen at the boundary
        self.steps += 1
        self.ctx_sum += self.n_dec
        for seq, take in chunks:
            seq.prefill_left -= take
        for _ in range(completing):
            seq = self.prefill.popleft()
            if seq.cancelled:
                seq.state = DONE
                continue
            self._sample(seq)
            if seq.generated >= seq.target:
                self._done(seq)
            else:
                seq.state, seq.join_step, seq.gen_at_join = DECODE, self.steps, seq.generated
                heapq.heappush(self._heap, (self.steps + seq.target - seq.generated, seq.no, seq))
                self.n_dec += 1
                self.ctx_sum += seq.prompt + seq.generated
        self._finish_due()
        self._in_boundary = False
        self._boundary()

    def _sample(self, seq: Seq) -> None:
        seq.generated += 1
        if seq.first_version is None:
            seq.first_version = self.version
        seq.last_version = self.version

    def _decode_run(self) -> None:
        while self._heap[0][2].cancelled or self._heap[0][2].state != DECODE:
            heapq.heappop(self._heap)
        k = self._heap[0][0] - self.steps
        p, n, speed = self.profile, self.n_dec, self.speed()
        c1 = (p.step_base_s + p.per_seq_s * n + p.per_ctx_token_s * self.ctx_sum) / speed
        c2 = p.per_ctx_token_s * n / (2 * speed)
        self._run = (self.clock.now, k, c1, c2)
        self._event = self.clock.after(_run_s(k, c1, c2), self._end_run, k)

    def _cut_run(self) -> None:
        start, k, c1, c2 = self._run
        elapsed = self.clock.now - start
        if c2 > 0:
            done = int((-(c1 - c2) + math.sqrt((c1 - c2) ** 2 + 4 * c2 * elapsed)) / (2 * c2))
        else:
            done = int(elapsed / c1)
        stop = min(done + 1, k)  # the step in progress completes
        if stop >= k:
            return
        self._event.cancel()
        self._run = (start, stop, c1, c2)
        self._event = self.clock.at(start + _run_s(stop, c1, c2), self._end_run, stop)

    def _end_run(self, k: int) -> None:
        self._event, self._run = None, None
        self._in_boundary = True
        self.steps += k
        self.ctx_sum += self.n_dec * k
        self._finish_due()
        self._in_boundary = False
        self._boundary()

    def _finish_due(self) -> None:
        while self._heap and self._heap[0][0] <= self.steps:
            _, _, seq = heapq.heappop(self._heap)
            if seq.cancelled or seq.state != DECODE:
                continue
            self.n_dec -= 1
            self.ctx_sum -= seq.prompt + seq.target
            seq.generated = seq.target
            seq.last_version = self.version
            self._done(seq)

    def _done(self, seq: Seq) -> None:
        seq.state = DONE
        self.in_flight -= 1
        self.on_finish(seq)

    def _purge(self) -> None:
        if not self._aborted:
            return
        for seq in self._aborted:
            if seq.state == DECODE:
                self.n_dec -= 1
                self.ctx_sum -= seq.prompt + seq.gen_at_join + self.steps - seq.join_step
            seq.state = DONE
        self._aborted = []
        self.waiting = deque(s for s in self.waiting if not s.cancelled)
        self.prefill = deque(s for s in self.prefill if not s.cancelled)

    def _set_busy(self, busy: bool) -> None:
        if busy == self.busy:
            return
        now = self.clock.now
        if self.busy:
            self.busy_s += now - self._busy_since
        self.busy, self._busy_since = busy, now
        self.on_busy(self)

    def busy_until_now(self) -> float:
        return self.busy_s + (self.clock.now - self._busy_since if self.busy else 0.0)


def _run_s(k: int, c1: float, c2: float) -> float:
    """Seconds of k decode steps whose i-th (from 0) costs c1 + 2 c2 i."""
    return c1 * k + c2 * k * (k - 1)
