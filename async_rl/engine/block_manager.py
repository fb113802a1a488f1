"""Paged KV-cache accounting: which block holds what, who uses it, and the prefix cache.

The pool has a fixed number of blocks of `block_size` token slots (the tensors live in the
model runner; this class only hands out block ids). A block is shared by reference count.
With prefix caching on, every *full* block is known by the chained hash of its tokens
(hash of the previous block's hash and this block's token ids), so the n samples of a
GRPO group and the turns of a conversation find the KV of their common prefix. Only full
blocks are shared, so no copy-on-write is needed: nobody ever writes into a shared block.

A block is registered under its hash when the step that computes its last token is
scheduled ("pending"), and marked computed once that step has run. A pending block may
already be shared inside the same step, because the runner writes every token's KV of a
layer before any attention of that layer reads the cache. A freed block whose KV is
computed stays findable in an LRU list until it is needed for something else.
"""

from __future__ import annotations

import logging
from collections import OrderedDict, deque

logger = logging.getLogger(__name__)


def chain_hash(prev_hash: int | None, tokens: tuple[int, ...]) -> int:
    """Hash of one full block of tokens, chained with the hash of the block before it."""
    return hash((prev_hash, tokens))


class BlockManager:
    """Hands out KV block ids, counts references, and keeps the prefix cache (hash -> block)."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks <= 0:
            raise ValueError(f"num_blocks: must be > 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_count = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.block_tokens: list[tuple[int, ...] | None] = [None] * num_blocks
        self.computed = [False] * num_blocks
        self.hash_to_block: dict[int, int] = {}
        self._free_plain: deque[int] = deque(range(num_blocks))  # free, holding nothing reusable
        self._free_cached: OrderedDict[int, None] = OrderedDict()  # free but findable by hash, oldest first
        self._pending: list[int] = []  # registered this step, computed when the step has run
        self.num_evictions = 0

    # ------------------------------------------------------------------ queries
    @property
    def num_free(self) -> int:
        """Blocks that can be handed out now (cached free blocks are evicted on demand)."""
        return len(self._free_plain) + len(self._free_cached)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def match_prefix(self, token_ids: list[int], max_blocks: int) -> tuple[list[int], list[int]]:
        """Longest run of cached full blocks at the start of `token_ids` -> (block ids, their hashes)."""
        blocks: list[int] = []
        hashes: list[int] = []
        if not self.enable_prefix_caching:
            return blocks, hashes
        prev: int | None = None
        bs = self.block_size
        for i in range(max_blocks):
            tokens = tuple(token_ids[i * bs:(i + 1) * bs])
            h = chain_hash(prev, tokens)
            b = self.hash_to_block.get(h)
            if b is None or self.block_tokens[b] != tokens:
                break
            blocks.append(b)
            hashes.append(h)
            prev = h
        return blocks, hashes

    def num_reclaimed(self, block_ids: list[int]) -> int:
        """How many of `block_ids` are free now (sharing them takes them out of the free pool)."""
        return sum(1 for b in block_ids if self.ref_count[b] == 0)

    # ------------------------------------------------------------------ changes
    def share(self, block_ids: list[int]) -> None:
        """Take one more reference on each block (a prefix hit)."""
        for b in block_ids:
            if self.ref_count[b] == 0:
                del self._free_cached[b]
            self.ref_count[b] += 1

    def allocate(self) -> int:
        """One fresh block with reference count 1; evicts the least recently freed cached block if needed."""
        if self._free_plain:
            b = self._free_plain.popleft()
        elif self._free_cached:
            b, _ = self._free_cached.popitem(last=False)
            self._forget(b)
            self.num_evictions += 1
        else:
            raise RuntimeError("KV cache: no free block (the scheduler should have preempted first)")
        self.ref_count[b] = 1
        return b

    def register(self, block_id: int, h: int, tokens: tuple[int, ...]) -> None:
        """Make a full block findable by its hash; it counts as computed after `commit()`."""
        if not self.enable_prefix_caching or h in self.hash_to_block or self.block_hash[block_id] is not None:
            return
        self.hash_to_block[h] = block_id
        self.block_hash[block_id] = h
        self.block_tokens[block_id] = tokens
        self.computed[block_id] = False
        self._pending.append(block_id)

    def commit(self) -> None:
        """The step ran: every block registered during it now holds its KV."""
        for b in self._pending:
            self.computed[b] = True
        self._pending.clear()

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference on each block; unreferenced computed blocks stay cached (LRU)."""
        for b in reversed(block_ids):  # tail blocks are the least likely to be shared: evict them first
            self.ref_count[b] -= 1
            if self.ref_count[b] < 0:
                raise RuntimeError(f"KV block {b} freed more often than allocated")
            if self.ref_count[b] == 0:
                if self.block_hash[b] is not None and self.computed[b]:
                    self._free_cached[b] = None
                else:
                    self._forget(b)
                    self._free_plain.append(b)

    def reset_prefix_cache(self) -> None:
        """Forget every hash (the KV was computed with other weights); blocks in use stay allocated.
        Touches only the blocks that hold a hash (every such block is in `hash_to_block`): a sweep over
        the whole pool cost 1.1-2.1 s per weight update on an H200, whose 40% share held 26M blocks of a
        small model (benchmarks/results/gpu_check.md)."""
        for b in list(self._free_cached):
            self._free_plain.append(b)
        self._free_cached.clear()
        for b in self.hash_to_block.values():
            self.block_hash[b] = None
            self.block_tokens[b] = None
            self.computed[b] = False
        self.hash_to_block.clear()
        self._pending.clear()

    def _forget(self, b: int) -> None:
        h = self.block_hash[b]
        if h is not None and self.hash_to_block.get(h) == b:
            del self.hash_to_block[h]
        self.block_hash[b] = None
        self.block_tokens[b] = None
        self.computed[b] = False
