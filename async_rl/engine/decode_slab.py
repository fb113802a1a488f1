"""Decoding sequences' KV in rows of fixed-width tiers, so that a decode step attends without gathering.

The paged pool (`ModelRunner.kv`) stays the truth: every token's K/V is written there, prefix
caching, chunked prefill and recompute read it. A decoding sequence also holds a row in one tier:

    kt [layers, rows, kv_heads, head_dim, width]   K, transposed (scores = q @ kt, no transpose per step)
    v  [layers, rows, kv_heads, width, head_dim]

Tier t is `base * 2**t` tokens wide; a sequence sits in the narrowest tier its context fits. A
step's decoding sequences of a tier take its rows 0..B-1, so a layer's attention over them reads
`kt[li, :B]` and `v[li, :B]` as contiguous views, masked past each row's context: one batched
matmul for the scores and one for the output. Widths double, so padding at most doubles what a
row reads. Reading the pool instead copies every decoding sequence's KV twice per layer and step
(`index_select` of its blocks, then heads first); on a 2-core CPU that cost more than the
attention it fed. A view cut shorter than its tier's width would be copied by every batched
matmul, hence the fixed widths.

A row is copied from the pool when its sequence starts decoding in a tier (or its row is stale: a
prefill or recompute chunk of that sequence rewrote its KV, or the row's length is not the
decode's position), then grows by the one token each step writes. Rows of sequences that do not
decode in a step are released, and the last rows move into the holes, so the rows stay 0..B-1.
All tiers together hold at most `budget_bytes`; the decoding sequences of a step that do not fit
read the pool (the ones already in rows stay there, then the narrowest rows are filled).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class TierStep:
    """A tier's decoding sequences in one step, in row order (rows 0..B-1)."""

    tier: Tier
    decodes: list[tuple[object, int, list[int]]]  # (sequence, position of its new token, block table)
    rows: torch.Tensor  # [B] 0..B-1
    positions: torch.Tensor  # [B]
    bias: torch.Tensor  # [B * kvH, G, width] 0 where a key exists, -inf past the row's context
    lens: torch.Tensor  # [B] int32, keys each row holds once this step's are written (position + 1)


class Tier:
    def __init__(self, width: int, layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device):
        self.width = width
        self.bytes_per_row = 2 * layers * kv_heads * head_dim * width * torch.empty(0, dtype=dtype).element_size()
        self.kt = torch.zeros(layers, 0, kv_heads, head_dim, width, dtype=dtype, device=device)
        self.v = torch.zeros(layers, 0, kv_heads, width, head_dim, dtype=dtype, device=device)
        self.row_of: dict[object, int] = {}  # sequence -> row
        self.length: list[int] = []  # tokens held per row; -1: stale

    @property
    def rows(self) -> int:
        return self.kt.shape[1]

    def resize(self, rows: int, keep: int | None = None) -> None:
        """Room for `rows` rows; rows 0..keep-1 (by default all that remain) keep their contents, the others
        are zeroed (a masked key or value must be finite: 0 x NaN is NaN)."""
        old = min(self.rows, rows, self.rows if keep is None else keep)
        kt = self.kt.new_empty(self.kt.shape[0], rows, *self.kt.shape[2:])
        v = self.v.new_empty(self.v.shape[0], rows, *self.v.shape[2:])
        kt[:, :old], v[:, :old] = self.kt[:, :old], self.v[:, :old]
        kt[:, old:].zero_()
        v[:, old:].zero_()
        self.kt, self.v = kt, v
        self.length = self.length[:old] + [0] * (rows - old)
        self.row_of = {seq: row for seq, row in self.row_of.items() if row < rows}

    def clear(self) -> None:
        self.row_of.clear()
        self.length = [0] * self.rows

    def place(self, decodes: list[tuple[object, int, list[int]]], pool: torch.Tensor, block_size: int) -> int:
        """Rows 0..B-1 for `decodes`; rows already holding a sequence's first `position` tokens are kept
        (moved down if at or past B), the others copied from the pool. Returns how many were copied."""
        need = len(decodes)
        wanted = {seq: (pos, table) for seq, pos, table in decodes}
        keep = {seq: row for seq, row in self.row_of.items()
                if seq in wanted and self.length[row] == wanted[seq][0]}
        free = sorted(set(range(need)) - {r for r in keep.values() if r < need})
        for seq, row in sorted(keep.items(), key=lambda kv: kv[1]):
            if row >= need:
                dst, n = free.pop(0), self.length[row]
                self.kt[:, dst, :, :, :n] = self.kt[:, row, :, :, :n]
                self.v[:, dst, :, :n] = self.v[:, row, :, :n]
                keep[seq] = dst
        length = [0] * self.rows
        for seq, row in keep.items():
            length[row] = self.length[row]
        copied = [(seq, pos, table) for seq, (pos, table) in wanted.items() if seq not in keep]
        for seq, pos, table in copied:
            keep[seq] = row = free.pop(0)
            self._copy_from_pool(row, pos, table, pool, block_size)
            length[row] = pos
        self.row_of, self.length = keep, length
        return len(copied)

    def _copy_from_pool(self, row: int, n: int, table: list[int], pool: torch.Tensor, block_size: int) -> None:
        """The first n tokens of a sequence's KV, from its blocks in the pool
        [layers, 2, blocks, block_size, kvH, D], into `row`."""
        if n == 0:
            return
        blocks = torch.tensor(table[:-(-n // block_size)], device=pool.device)
        picked = pool.index_select(2, blocks).flatten(2, 3)[:, :, :n]  # [layers, 2, n, kvH, D]
        self.kt[:, row, :, :, :n] = picked[:, 0].permute(0, 2, 3, 1)
        self.v[:, row, :, :n] = picked[:, 1].transpose(1, 2)


class DecodeSlab:
    def __init__(self, layers: int, kv_heads: int, head_dim: int, group: int, dtype: torch.dtype,
                 device: torch.device, budget_bytes: int, max_context: int, base: int = 64):
        self.kv_heads, self.group, self.dtype, self.device = kv_heads, group, dtype, device
        self.budget_bytes = budget_bytes
        self.rows_copied = 0  # rows filled from the pool (a sequence starting to decode, or entering a wider tier)
        self.pool_steps = 0  # steps in which some decodes read the pool: not all of them fit the budget
        self.tiers: list[Tier] = []
        width = base
        while True:
            self.tiers.append(Tier(width, layers, kv_heads, head_dim, dtype, device))
            if width >= max_context:
                break
            width *= 2

    def forget(self, seq) -> None:
        """`seq`'s KV in the pool is being (re)written by a prefill or recompute chunk: its row is stale."""
        for tier in self.tiers:
            row = tier.row_of.get(seq)
            if row is not None:
                tier.length[row] = -1

    def place(self, decodes: list[tuple[object, int, list[int]]], pool: torch.Tensor,
              block_size: int) -> list[TierStep] | None:
        """Rows for the step's decoding sequences (seq, position of the new token, block table), each in the
        narrowest tier that holds its context; None (holding nothing) for a context past every tier. What
        would exceed the budget is left out of the steps returned: those sequences read the pool this step
        (`pool_steps` counts such steps). Rows already holding their sequence's KV are kept first, then
        the narrowest rows are taken, so the slab holds as many sequences as fit and keeps holding them."""
        by_tier: list[list[tuple[object, int, list[int]]]] = [[] for _ in self.tiers]
        for d in decodes:
            t = next((i for i, tier in enumerate(self.tiers) if d[1] < tier.width), None)
            if t is None:  # longer than the model's context: never scheduled, but read the pool then
                return self._give_up()
            by_tier[t].append(d)
        by_tier, target = self._rows_for(by_tier)
        steps = []
        for tier, rows, ds in zip(self.tiers, target, by_tier):
            if rows > tier.rows:
                tier.resize(rows)
            self.rows_copied += tier.place(ds, pool, block_size)
            if rows < tier.rows:
                tier.resize(rows, keep=len(ds))
            if ds:
                ds.sort(key=lambda d: tier.row_of[d[0]])
                steps.append(self._step(tier, ds))
        if sum(len(ds) for ds in by_tier) < len(decodes):
            self.pool_steps += 1
        return steps

    def _rows_for(self, by_tier: list[list[tuple[object, int, list[int]]]]) -> tuple[list[list], list[int]]:
        """The decodes each tier takes this step and the rows it holds for them. Resizing a tier copies all of
        it: at 256 requests of the engine_throughput workload (fp32 SmolLM2-135M, 512 MB of KV) resizes by
        the step's needs took ~10% of the wall time, the slab at its budget, sequences moving to wider
        tiers as they grow. So a tier keeps the rows it has; one short of rows grows to twice them, else to a
        multiple of 8 over its need, whichever fits the budget. Over the budget, each tier keeps its rows and
        the decodes past them read the pool, until a quarter of the budget lies in rows no decode uses: then
        every tier is cut to its need (to a multiple of 8, else to the row, `_what_fits`)."""
        need = [len(ds) for ds in by_tier]
        round8 = [-(-n // 8) * 8 for n in need]
        rows = [t.rows for t in self.tiers]
        grown = [max(r8, 2 * r) if n > r else r for r, n, r8 in zip(rows, need, round8)]
        snug = [r8 if n > r else r for r, n, r8 in zip(rows, need, round8)]
        for target in (grown, snug):
            if self._bytes(target) <= self.budget_bytes:
                return by_tier, target
        idle = sum(max(0, r - n) * t.bytes_per_row for r, n, t in zip(rows, need, self.tiers))
        if 4 * idle < self.budget_bytes:
            room = self.budget_bytes - self._bytes(rows)
            rows = list(rows)
            for i, (n, t) in enumerate(zip(need, self.tiers)):  # room the budget still has goes to the narrowest
                more = min(max(0, n - rows[i]), room // t.bytes_per_row)
                rows[i] += more
                room -= more * t.bytes_per_row
            return self._what_fits(by_tier, rows), rows
        if self._bytes(round8) <= self.budget_bytes:
            return by_tier, round8
        by_tier = self._what_fits(by_tier)
        return by_tier, [len(ds) for ds in by_tier]

    def _bytes(self, rows: list[int]) -> int:
        return sum(r * t.bytes_per_row for r, t in zip(rows, self.tiers))

    def _what_fits(self, by_tier: list[list[tuple[object, int, list[int]]]],
                   caps: list[int] | None = None) -> list[list[tuple[object, int, list[int]]]]:
        """The decodes of each tier that fit the budget together (and at most `caps[i]` in tier i): first those
        whose row already holds their KV (no copy, and the slab keeps what it holds from step to step), then
        the narrowest."""
        held = [[d for d in ds if d[0] in tier.row_of and tier.length[tier.row_of[d[0]]] == d[1]]
                for tier, ds in zip(self.tiers, by_tier)]
        fresh = [[d for d in ds if d[0] not in kept] for ds, kept in zip(by_tier, ({d[0] for d in h} for h in held))]
        room, out = self.budget_bytes, [[] for _ in self.tiers]
        left = list(caps) if caps is not None else [len(ds) for ds in by_tier]
        for group in (held, fresh):
            for i, tier in enumerate(self.tiers):
                n = min(len(group[i]), room // tier.bytes_per_row, left[i])
                out[i] += group[i][:n]
                room -= n * tier.bytes_per_row
                left[i] -= n
        return out

    def _give_up(self) -> None:
        self.pool_steps += 1
        for tier in self.tiers:
            tier.clear()
        return None

    def _step(self, tier: Tier, decodes: list[tuple[object, int, list[int]]]) -> TierStep:
        b, dev = len(decodes), self.device
        pos = [p for _, p, _ in decodes]
        if max(pos) >= tier.width:  # the compiled attention writes at lens - 1
            raise AssertionError(f"decode slab: a position past its tier's width {tier.width}")
        positions = torch.tensor(pos, device=dev)
        keep = torch.arange(tier.width, device=dev)[None, :] <= positions[:, None]  # [B, width]
        bias = torch.zeros(keep.shape, dtype=self.dtype, device=dev).masked_fill_(~keep, float("-inf"))
        bias = bias[:, None, None, :].expand(b, self.kv_heads, self.group, tier.width)
        bias = bias.reshape(-1, self.group, tier.width)
        return TierStep(tier, decodes, torch.arange(b, device=dev), positions, bias, (positions + 1).to(torch.int32))

    @staticmethod
    def write(li: int, step: TierStep, k: torch.Tensor, v: torch.Tensor) -> None:
        """The step's new K/V [B, kvH, D] of a tier's rows 0..B-1 at their positions, in layer li."""
        step.tier.kt[li].permute(0, 3, 1, 2)[step.rows, step.positions] = k
        step.tier.v[li].transpose(1, 2)[step.rows, step.positions] = v

    @staticmethod
    def advance(steps: list[TierStep]) -> None:
        """After the step: each row holds its new token too."""
        for step in steps:
            for seq, pos, _ in step.decodes:
                step.tier.length[step.tier.row_of[seq]] = pos + 1
