"""BlockManager: allocation, reference counts, prefix-hash reuse and LRU eviction."""

import pytest

from async_rl.engine.block_manager import BlockManager, chain_hash


def fill(bm, tokens):
    """Allocate, register and commit the full blocks of `tokens` like a computed sequence would."""
    bs = bm.block_size
    table, prev = [], None
    for i in range(len(tokens) // bs):
        block = tuple(tokens[i * bs:(i + 1) * bs])
        prev = chain_hash(prev, block)
        table.append(bm.allocate())
        bm.register(table[-1], prev, block)
    bm.commit()
    return table


def test_allocate_and_free_counts():
    bm = BlockManager(4, 2)
    blocks = [bm.allocate() for _ in range(4)]
    assert sorted(blocks) == [0, 1, 2, 3] and bm.num_free == 0 and bm.num_used == 4
    with pytest.raises(RuntimeError, match="no free block"):
        bm.allocate()
    bm.free(blocks[:2])
    assert bm.num_free == 2
    with pytest.raises(RuntimeError, match="freed more often"):
        bm.free([blocks[0]])


def test_prefix_match_shares_and_ref_counts():
    bm = BlockManager(8, 2)
    tokens = [1, 2, 3, 4, 5, 6, 7]
    table = fill(bm, tokens)
    assert len(table) == 3
    blocks, hashes = bm.match_prefix(tokens, 3)
    assert blocks == table and len(hashes) == 3
    assert bm.match_prefix([1, 2, 3, 9, 5, 6], 3)[0] == table[:1]  # stops at the first differing block
    assert bm.match_prefix([9, 2, 3, 4], 2)[0] == []
    bm.share(blocks[:2])
    assert [bm.ref_count[b] for b in table] == [2, 2, 1]
    bm.free(table)
    assert [bm.ref_count[b] for b in table] == [1, 1, 0]
    assert bm.match_prefix(tokens, 3)[0] == table  # a freed computed block stays findable


def test_chained_hash_depends_on_previous_blocks():
    bm = BlockManager(8, 2)
    fill(bm, [1, 2, 3, 4])
    # the second block's tokens alone match, but after a different first block they must not
    assert bm.match_prefix([9, 9, 3, 4], 2)[0] == []


def test_free_cached_blocks_are_evicted_lru_when_needed():
    bm = BlockManager(4, 2)
    a = fill(bm, [1, 1, 2, 2])
    b = fill(bm, [3, 3, 4, 4])
    bm.free(a)
    bm.free(b)
    assert bm.num_free == 4 and len(bm.hash_to_block) == 4
    fresh = bm.allocate()  # no plain free block: evicts the least recently freed cached one
    assert fresh == a[1] and bm.num_evictions == 1  # tails are freed (and so evicted) first
    assert bm.match_prefix([1, 1, 2, 2], 2)[0] == a[:1]
    assert bm.match_prefix([3, 3, 4, 4], 2)[0] == b


def test_share_takes_cached_block_out_of_free_pool():
    bm = BlockManager(2, 2)
    a = fill(bm, [1, 1])
    bm.free(a)
    blocks, _ = bm.match_prefix([1, 1, 5], 1)
    assert bm.num_reclaimed(blocks) == 1
    bm.share(blocks)
    assert bm.num_free == 1 and bm.ref_count[a[0]] == 1


def test_uncomputed_block_is_forgotten_when_freed():
    bm = BlockManager(2, 2)
    b = bm.allocate()
    bm.register(b, chain_hash(None, (1, 1)), (1, 1))  # registered, step never ran
    bm.free([b])
    assert bm.match_prefix([1, 1, 2], 1)[0] == []


def test_reset_prefix_cache_and_disabled_caching():
    bm = BlockManager(4, 2)
    a = fill(bm, [1, 1, 2, 2])
    bm.free(a[1:])
    bm.reset_prefix_cache()
    assert bm.match_prefix([1, 1, 2, 2], 2)[0] == [] and bm.ref_count[a[0]] == 1 and bm.num_free == 3
    off = BlockManager(4, 2, enable_prefix_caching=False)
    fill(off, [1, 1])
    assert off.match_prefix([1, 1, 2], 1)[0] == [] and not off.hash_to_block


class _Counted(list):
    """A per-block list that counts the reads and writes of its items and refuses to be swept."""

    def __init__(self, items, counts):
        super().__init__(items)
        self.counts = counts

    def __getitem__(self, i):
        self.counts["touched"] += 1
        return super().__getitem__(i)

    def __setitem__(self, i, value):
        self.counts["touched"] += 1
        super().__setitem__(i, value)

    def __iter__(self):
        raise AssertionError("the whole pool was swept")


def test_a_weight_update_resets_the_prefix_cache_without_sweeping_the_pool():
    """reset_prefix_cache runs at every weight update: it touches the blocks that hold a hash, not all of
    them. On an H200 the engine's share held 26M blocks of the debug model and a sweep took 1.1-2.1 s an
    update (benchmarks/results/gpu_check.md). Counted, not timed: a clock bound fails on a loaded machine."""
    bm = BlockManager(2_000_000, 2)
    a = fill(bm, [1, 1, 2, 2, 3, 3])
    bm.free(a[1:])
    counts = {"touched": 0}
    for name in ("block_hash", "block_tokens", "computed"):
        setattr(bm, name, _Counted(getattr(bm, name), counts))
    bm.reset_prefix_cache()
    assert counts["touched"] <= 3 * len(a), counts  # three per hashed block, whatever the pool's size
    assert all(bm.block_hash[b] is None and bm.block_tokens[b] is None and not bm.computed[b] for b in a)
    assert bm.match_prefix([1, 1, 2, 2], 2)[0] == [] and bm.num_free == 2_000_000 - 1
