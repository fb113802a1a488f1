"""Who runs in the next step, and how many of their tokens: continuous batching with preemption.

Each step has a token budget (`max_tokens_per_step`) and a cap on running sequences
(`max_running`). Running sequences go first, in admission order: a decoding sequence
costs one token, a sequence in the middle of a (chunked) prefill or recompute costs the
rest of its uncomputed tokens, cut to the budget. If the KV pool cannot hold a running
sequence's next tokens, the most recently admitted running sequence that has not been
scheduled in this step is preempted: its blocks are freed and it goes back to the front
of the waiting queue, to be recomputed later. What budget is left admits waiting
sequences (oldest first), reusing cached prefix blocks where their tokens match.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass

from async_rl.engine.block_manager import BlockManager, chain_hash
from async_rl.engine.sequence import Sequence, SequenceStatus

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class ScheduledChunk:
    """Compute tokens [start, start + length) of `seq`; sample the next token if that reaches its end."""

    seq: Sequence
    start: int
    length: int

    @property
    def samples(self) -> bool:
        return self.start + self.length == len(self.seq)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_running: int, max_tokens_per_step: int):
        self.bm = block_manager
        self.max_running = max_running
        self.max_tokens_per_step = max_tokens_per_step
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.prefix_lookup_tokens = 0
        self.prefix_hit_tokens = 0

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ------------------------------------------------------------------ scheduling
    def schedule(self) -> list[ScheduledChunk]:
        budget = self.max_tokens_per_step
        chunks: list[ScheduledChunk] = []
        scheduled: set[int] = set()
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(len(seq) - seq.num_computed, budget)
            if not self._make_room(seq, seq.num_computed + n, scheduled):
                continue  # seq itself was preempted; running[i] is now the next one
            chunks.append(self._chunk(seq, n))
            scheduled.add(id(seq))
            budget -= n
            i += 1
        while self.waiting and budget > 0 and len(self.running) < self.max_running:
            chunk = self._admit(self.waiting[0], budget)
            if chunk is None:
                break
            self.waiting.popleft()
            chunks.append(chunk)
            budget -= chunk.length
        return chunks

    def _make_room(self, seq: Sequence, num_tokens: int, scheduled: set[int]) -> bool:
        """Free blocks for `seq` to hold `num_tokens`, preempting later sequences; False if seq was preempted."""
        need = self.bm.blocks_needed(num_tokens) - len(seq.block_table)
        while need > self.bm.num_free:
            victim = next((s for s in reversed(self.running) if id(s) not in scheduled and s is not seq), None)
            self.preempt(victim or seq)
            if victim is None:
                return False
        return True

    def _admit(self, seq: Sequence, budget: int) -> ScheduledChunk | None:
        bs = self.bm.block_size
        blocks, hashes = ([], [])
        if not seq.block_table:  # may hit the prefix cache; keep >= 1 token to compute for the logits
            blocks, hashes = self.bm.match_prefix(seq.token_ids, (len(seq) - 1) // bs)
        start = len(blocks) * bs if blocks else seq.num_computed
        n = min(len(seq) - start, budget)
        need = self.bm.blocks_needed(start + n) - max(len(blocks), len(seq.block_table))
        if need > self.bm.num_free - self.bm.num_reclaimed(blocks):
            return None
        if blocks:
            self.bm.share(blocks)
            seq.block_table = list(blocks)
            seq.block_hashes = list(hashes)
            seq.num_computed = start
            seq.recompute_left = max(0, seq.recompute_left - start)
        if not seq.admitted_once:
            seq.prefix_cached_tokens = start
            seq.admitted_once = True
        self.prefix_lookup_tokens += len(seq)
        self.prefix_hit_tokens += len(blocks) * bs
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        return self._chunk(seq, n)

    def _chunk(self, seq: Sequence, n: int) -> ScheduledChunk:
        """Allocate blocks for the chunk and register the full blocks it completes in the prefix cache."""
        bs = self.bm.block_size
        end = seq.num_computed + n
        while len(seq.block_table) * bs < end:
            seq.block_table.append(self.bm.allocate())
        for b in range(len(seq.block_hashes), end // bs):
            tokens = tuple(seq.token_ids[b * bs:(b + 1) * bs])
            h = chain_hash(seq.block_hashes[-1] if seq.block_hashes else None, tokens)
            seq.block_hashes.append(h)
            if not seq.kv_mixed:
                self.bm.register(seq.block_table[b], h, tokens)
        return ScheduledChunk(seq, seq.num_computed, n)

    # ------------------------------------------------------------------ state changes
    def preempt(self, seq: Sequence) -> None:
        """Free the sequence's KV and put it at the front of the waiting queue (recomputed later)."""
        self.running.remove(seq)
        self.bm.free(seq.block_table)
        seq.reset_kv()
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
        logger.debug("preempted %s (%d tokens)", seq.request_id, len(seq))

    def interrupt_all(self) -> list[Sequence]:
        """Drop the KV of every started sequence (weights changed); they recompute from the front of the queue."""
        started = [s for s in self.running] + [s for s in self.waiting if s.admitted_once]
        for seq in reversed(self.running):
            self.bm.free(seq.block_table)
            seq.reset_kv()
            seq.status = SequenceStatus.WAITING
            self.waiting.appendleft(seq)
        self.running.clear()
        return started

    def finish(self, seq: Sequence, reason: str) -> None:
        """Mark finished and free its blocks at once (running or waiting)."""
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status == SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self.bm.free(seq.block_table)
        seq.block_table = []
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
