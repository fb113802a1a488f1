"""The decode slab (async_rl/engine/decode_slab.py): decoding sequences read their KV from slab rows,
and must compute exactly what the paged pool gives, through every way a row can go stale.

Real tiny Llama models and real engine steps; the reference is a fresh Hugging Face forward of
the same weights, and the same engine with the slab off (KV read from the pool).
"""

import copy

import pytest
import torch

from async_rl.engine.decode_slab import DecodeSlab, Tier
from async_rl.types import SamplingParams

from tests.unit.test_engine_core import hf_logprobs, model, prompts, run, tok  # noqa: F401 (fixtures)
from tests.unit.test_engine_core import make_engine as engine


def test_rows_across_tiers_match_hf_and_the_pool(model, tok):
    """Sequences grow from the 64-wide tier through 128 into 256 while others finish and free rows
    (rows move down): log-probs equal HF's, tokens equal the pool path's."""
    reqs = {f"r{i}": (p, SamplingParams(max_new_tokens=20 + 45 * (i % 4), temperature=1.0, ignore_eos=True, seed=i))
            for i, p in enumerate(prompts(tok, 12))}
    with_slab = engine(model, tok)
    outs = run(with_slab, reqs)
    pool = run(engine(model, tok, decode_slab=False), reqs)
    stats = with_slab.stats()
    assert stats["engine/slab_pool_steps"] == 0
    # each sequence is copied into a row once, plus once per wider tier it enters (64 -> 128 -> 256)
    # (a decode at position pos needs pos + 1 keys)
    longest = [len(p) + len(outs[r].output_ids) - 1 for r, (p, _) in reqs.items()]
    assert stats["engine/slab_rows_copied"] == sum(1 + (n > 64) + (n > 128) for n in longest)
    assert max(longest) > 128
    for rid, (prompt, params) in reqs.items():
        assert outs[rid].output_ids == pool[rid].output_ids, rid
        ref = hf_logprobs(model, prompt, outs[rid].output_ids, 1.0)
        assert max(abs(a - b) for a, b in zip(ref, outs[rid].output_logprobs)) <= 1e-4, rid


@pytest.mark.parametrize("update_at", range(3, 11))
def test_a_row_is_not_reused_after_a_chunked_recompute(model, tok, update_at):
    """New weights mid-decode: the KV is recomputed in chunks of 8 tokens. Where the last chunk is one
    token it looks like a decode at the row's own length, but every earlier position changed: the row
    must be copied again from the pool (the runner marks it stale), or the log-probs after the update
    are those of the old weights' KV."""
    new = copy.deepcopy(model)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    eng = engine(copy.deepcopy(model), tok, max_tokens_per_step=8)
    prompt = prompts(tok, 8)[7][:9]
    reqs = {"r": (prompt, SamplingParams(max_new_tokens=16, temperature=1.0, ignore_eos=True, seed=1))}
    out = run(eng, reqs, lambda e, steps: steps == update_at and e.update_weights(new.state_dict(), version=1))["r"]
    cut = out.output_versions.index(1)
    ref = hf_logprobs(model, prompt, out.output_ids, 1.0)[:cut] + hf_logprobs(new, prompt, out.output_ids, 1.0)[cut:]
    assert max(abs(a - b) for a, b in zip(ref, out.output_logprobs)) <= 1e-4


def test_over_budget_steps_read_the_pool_and_agree(model, tok):
    """A KV budget too small for the slab's rows: those steps read the pool, counted, same tokens."""
    reqs = {f"r{i}": (p, SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True))
            for i, p in enumerate(prompts(tok, 16))}
    small = engine(model, tok, kv_cache_mb=0.05)
    outs = run(small, reqs)
    assert small.stats()["engine/slab_pool_steps"] > 0
    assert small.stats()["engine/slab_rows_copied"] > 0  # and steps that fit used the slab
    pool = run(engine(model, tok, kv_cache_mb=0.05, decode_slab=False), reqs)
    assert {r: o.output_ids for r, o in outs.items()} == {r: o.output_ids for r, o in pool.items()}


def test_rows_stay_packed_and_hold_their_sequences_kv():
    """Slab rows against the pool by hand: sequences leave, the last row moves into the hole, a stale
    row is copied again, a sequence past a tier's width moves to the next tier."""
    layers, kvh, d, bs = 2, 2, 4, 4
    pool = torch.randn(layers, 2, 40, bs, kvh, d)
    slab = DecodeSlab(layers, kvh, d, group=1, dtype=torch.float32, device=torch.device("cpu"),
                      budget_bytes=1 << 30, max_context=32, base=8)
    seqs = {name: list(range(i * 8, i * 8 + 8)) for i, name in enumerate("abcd")}  # block tables

    def write(steps):  # what the runner does in each layer: the new token's K/V at its position
        for step in steps:
            for li in range(layers):
                new = [pool[li, :, t[pos // bs], pos % bs] for _, pos, t in step.decodes]  # [2, kvH, D] each
                DecodeSlab.write(li, step, torch.stack([n[0] for n in new]), torch.stack([n[1] for n in new]))
        slab.advance(steps)

    def check(steps):
        for step in steps:
            for row, (seq, pos, table) in enumerate(step.decodes):
                assert step.tier.row_of[seq] == row
                keys = pool[:, 0, table].flatten(1, 2)[:, :pos]  # [layers, pos, kvH, D]
                assert torch.equal(step.tier.kt[:, row, :, :, :pos], keys.permute(0, 2, 3, 1))
                assert torch.equal(step.tier.v[:, row, :, :pos], pool[:, 1, table].flatten(1, 2)[:, :pos].transpose(1, 2))

    steps = slab.place([(s, 5, seqs[s]) for s in "abcd"], pool, bs)
    assert [s.tier.width for s in steps] == [8] and slab.rows_copied == 4
    write(steps)
    steps = slab.place([(s, 6, seqs[s]) for s in "bd"], pool, bs)  # a and c finished: d moves into row 0
    assert slab.rows_copied == 4 and [d[0] for d in steps[0].decodes] == ["d", "b"]
    check(steps)
    write(steps)
    slab.forget("b")  # a prefill or recompute chunk rewrote b's KV
    steps = slab.place([(s, 7, seqs[s]) for s in "bd"], pool, bs)
    assert slab.rows_copied == 5
    check(steps)
    write(steps)
    steps = slab.place([("b", 8, seqs["b"]), ("d", 7, seqs["d"])], pool, bs)  # b past 8 wide; d repeats 7
    assert [(s.tier.width, [x[0] for x in s.decodes]) for s in steps] == [(8, ["d"]), (16, ["b"])]
    assert slab.rows_copied == 7  # b into the 16-wide tier; d's row holds 8, not 7 tokens: copied again
    check(steps)


def test_a_slab_over_its_budget_holds_what_fits_and_keeps_holding_it():
    """Room for 3 rows of the 8-wide tier and 4 decoding sequences: 3 get rows, the 4th reads the pool
    (the step is counted); at the next step the same 3 keep their rows (no copy), and a context past
    every tier gives up the whole step."""
    slab = DecodeSlab(1, 1, 4, group=1, dtype=torch.float32, device=torch.device("cpu"),
                      budget_bytes=2 * 8 * 4 * 4 * 3, max_context=16, base=8)  # 3 rows of the 8-wide tier
    pool = torch.randn(1, 2, 8, 4, 1, 4)
    steps = slab.place([(i, 3, [i]) for i in range(3)], pool, 4)
    assert [d[0] for s in steps for d in s.decodes] == [0, 1, 2] and slab.pool_steps == 0
    slab.advance(steps)
    steps = slab.place([(i, 4, [i]) for i in (3, 0, 1, 2)], pool, 4)  # 3 is new: no room for it
    assert sorted(d[0] for s in steps for d in s.decodes) == [0, 1, 2]
    assert slab.pool_steps == 1 and slab.rows_copied == 3  # the rows held were kept, none copied again
    assert sum(t.rows * t.bytes_per_row for t in slab.tiers) <= slab.budget_bytes
    assert slab.place([(0, 16, [0, 1, 2, 3, 4])], pool, 4) is None  # past the widest tier
    assert all(not t.row_of for t in slab.tiers)


def test_a_step_refuses_a_position_past_its_tiers_width():
    """The compiled attention writes the new K/V at lens - 1 without a bounds check of its own: a step
    whose position lies past its tier's width is refused before any write (placement never builds one;
    this guards the kernel against a placement bug)."""
    slab = DecodeSlab(1, 1, 4, group=1, dtype=torch.float32, device=torch.device("cpu"),
                      budget_bytes=1 << 16, max_context=16, base=8)
    tier = slab.tiers[0]
    assert slab._step(tier, [(0, tier.width - 1, [0])]).lens.tolist() == [tier.width]
    with pytest.raises(AssertionError, match="past its tier's width"):
        slab._step(tier, [(0, 2, [0]), (1, tier.width, [1])])


def test_decodes_left_out_of_the_slab_read_the_pool_in_the_same_step(model, tok):
    """A budget for a few rows only: every step mixes slab rows and decodes read from the pool, and
    the tokens and log-probs are those of the engine with the slab off."""
    reqs = {f"r{i}": (p, SamplingParams(max_new_tokens=24, temperature=1.0, ignore_eos=True, seed=i))
            for i, p in enumerate(prompts(tok, 12))}
    eng = engine(model, tok)
    eng.runner.slab.budget_bytes = 4 * eng.runner.slab.tiers[0].bytes_per_row  # 4 of the 12 sequences
    outs = run(eng, reqs)
    stats = eng.stats()
    assert stats["engine/slab_pool_steps"] > 10 and stats["engine/slab_rows_copied"] > 0
    pool = run(engine(model, tok, decode_slab=False), reqs)
    for rid in reqs:
        assert outs[rid].output_ids == pool[rid].output_ids, rid
        assert max(abs(a - b) for a, b in zip(outs[rid].output_logprobs, pool[rid].output_logprobs)) <= 1e-4, rid


def test_a_slab_at_its_budget_does_not_resize_every_step(monkeypatch):
    """24 sequences moving through the 8-16-32-64 tiers with a budget that cannot hold them all: resizing
    copies a whole tier, so tiers keep the rows they have and are cut down only once a quarter of the
    budget lies idle. Resizing to each step's needs (the policy before) resized 39 times in 40 steps. Every
    row a step reads holds its sequence's KV (a shrink that kept no rows fails here)."""
    resizes = []
    real = Tier.resize
    monkeypatch.setattr(Tier, "resize", lambda tier, *a, **k: (resizes.append(tier.width), real(tier, *a, **k))[1])
    slab = DecodeSlab(1, 1, 4, group=1, dtype=torch.float32, device=torch.device("cpu"),
                      budget_bytes=40000, max_context=64, base=8)
    pool = torch.randn(1, 2, 64, 4, 1, 4)
    start = {s: (3 * s) % 40 for s in range(24)}
    keys, values = pool[0, 0].reshape(-1, 1, 4)[:64], pool[0, 1].reshape(-1, 1, 4)[:64]  # token p: slot p (blocks 0-15)
    for step in range(40):
        steps = slab.place([(s, start[s] + step, list(range(16))) for s in range(24) if start[s] + step < 64], pool, 4)
        assert sum(t.rows * t.bytes_per_row for t in slab.tiers) <= slab.budget_bytes
        for ts in steps:  # what the runner does per layer: the new token's K/V into its row
            DecodeSlab.write(0, ts, keys[ts.positions], values[ts.positions])
            for row, (_, pos, _) in enumerate(ts.decodes):  # every row holds its sequence's KV, kept or copied
                assert torch.equal(ts.tier.kt[0, row, :, :, :pos + 1], keys[:pos + 1].permute(1, 2, 0))
                assert torch.equal(ts.tier.v[0, row, :, :pos + 1], values[:pos + 1].transpose(0, 1))
        slab.advance(steps)
    assert len(resizes) <= 20, resizes
    assert slab.pool_steps < 40  # and the slab still holds what fits: not every step read the pool
