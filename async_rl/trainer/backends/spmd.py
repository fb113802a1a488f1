"""What every multi-process backend (fsdp, megatron) shares: rank 0 plans a step, ships each rank
its rows over the process group, and every rank runs the same optimizer steps on its share.

    stats = trainer.train_step(groups)     # rank 0: filter, advantages, minibatches; sends the shares
    trainer.follow_train_step()            # ranks 1..N-1, in lock step: receive this rank's share, train

Rank 0 alone sees the trajectories. It plans the minibatches and micro-batches (its RNG
draws the split), gives data-parallel rank d of D the trajectories d, d+D, d+2D, ... of every
micro-batch, collated in the trainer's layout (padded rows, or one packed row per share), and
sends each follower its shares as one TensorDict over the trainer's process group (gloo on
CPU, NCCL on CUDA), after a small int64 header with their shapes and trained-token counts.
Ranks that hold the same rows (the tensor-parallel peers of a megatron data-parallel rank)
get the same share. Nothing of the batch goes through the rendezvous store: it carries only
the command names (async_rl/launch/trainer_ranks.py).

A rank whose share of a micro-batch is empty gets its first trajectory with no trained token
(weight 0), so every rank runs every micro-batch's forward and backward: FSDP's
collectives stay in lock step, and every rank's stats have the same keys.
"""

from __future__ import annotations

import logging
import os
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from tensordict import TensorDict

from async_rl.config import Config, TrainerConfig
from async_rl.trainer.backends import RankInfo
from async_rl.trainer.batching import Batch, trained_tokens
from async_rl.trainer.plan import Minibatch, Share
from async_rl.trainer.stats import StatsAccumulator
from async_rl.trainer.trainer import PPOTrainer
from async_rl.types import Trajectory
from async_rl.utils.hardware import resolve_device

logger = logging.getLogger(__name__)

_SKIP = -1  # header of a step rank 0 did not train (every trajectory dropped): followers do not either
_GLOO_DRAIN_S = 0.05  # see SPMDTrainer.close


def _pack(shares: list[Share]) -> TensorDict:
    """One TensorDict of a rank's micro-batches (`m{minibatch}_{micro}`), built the same way on both ends
    so their consolidated layouts match."""
    return TensorDict({f"m{m}_{k}": b.to_tensordict() for m, s in enumerate(shares) for k, b in enumerate(s.micros)},
                      batch_size=[])


def _has_rows(shares: list[Share] | None) -> bool:
    """Whether a step's shares carry any micro-batch: the one rule both ends follow to send / expect data."""
    return bool(shares) and any(s.micros for s in shares)


def _header(shares: list[Share] | None) -> torch.Tensor:
    """[n] int64: number of minibatches (or _SKIP), then per minibatch its token total, its micro-batch
    count and each micro-batch's (rows, length, trained tokens)."""
    if shares is None:
        return torch.tensor([_SKIP])
    out = [len(shares)]
    for s in shares:
        out += [s.total, len(s.micros)] + [d for b, n in zip(s.micros, s.tokens) for d in (*b.input_ids.shape, n)]
    return torch.tensor(out)


def send_shares(shares: list[Share] | None, dst: int, device: torch.device) -> None:
    """Rank 0 -> rank `dst`: its shares of this step (None: no step)."""
    header = _header(shares).to(device)
    dist.send(torch.tensor([header.numel()], device=device), dst=dst)
    dist.send(header, dst=dst)
    if _has_rows(shares):
        _pack(shares).consolidate(metadata=True).send(dst, consolidated=True)


def recv_shares(device: torch.device) -> list[Share] | None:
    """A follower: its shares of this step from rank 0, on `device` (None: rank 0 trained nothing)."""
    size = torch.zeros(1, dtype=torch.long, device=device)
    dist.recv(size, src=0)
    header = torch.zeros(int(size.item()), dtype=torch.long, device=device)
    dist.recv(header, src=0)
    h = header.tolist()
    if h[0] == _SKIP:
        return None
    shares, i = [], 1
    for _ in range(h[0]):
        total, n = h[i], h[i + 1]
        dims = h[i + 2:i + 2 + 3 * n]
        shares.append(Share(total=total, micros=[Batch.empty(dims[3 * k], dims[3 * k + 1], device) for k in range(n)],
                            tokens=dims[2::3]))
        i += 2 + 3 * n
    if not _has_rows(shares):
        return shares
    td = _pack(shares).consolidate(metadata=True)
    td.recv(0, consolidated=True)
    return [Share(total=s.total, micros=[Batch.from_tensordict(td[f"m{m}_{k}"]) for k in range(len(s.micros))],
                  tokens=s.tokens) for m, s in enumerate(shares)]


class SPMDTrainer(PPOTrainer):
    """PPOTrainer over a process group: rank 0 plans and distributes, every rank optimises its share.

    Subclasses set `rank`, `world_size`, `dp_size`, `stats_group` and say which data-parallel rank
    each global rank is (`dp_rank_of`)."""

    rank: int
    world_size: int
    dp_size: int
    stats_group: dist.ProcessGroup | None = None  # the ranks whose stats add up (the data-parallel ones)
    can_probe = False  # a forward is a collective: the KL probe would leave the other ranks behind

    def dp_rank_of(self, rank: int) -> int:
        raise NotImplementedError

    def train_step(self, groups):
        stats = super().train_step(groups)
        if stats.get("train/skipped_batch"):
            for r in range(1, self.world_size):
                send_shares(None, r, self.device)
        return stats

    def follow_train_step(self) -> dict[str, float]:
        """Ranks 1..N-1: the step rank 0 is taking (its `train_step`), on this rank's share."""
        shares = recv_shares(self.device)
        if shares is None:
            return {}
        stats = self._optimize(shares)
        self.policy_version += 1
        return stats

    def _shares(self, trajs: list[Trajectory], adv: torch.Tensor, plans: list[Minibatch]) -> list[Share]:
        """Every data-parallel rank's rows of each minibatch: sent to the followers, rank 0's kept."""
        per_dp = [[self._rank_share(trajs, adv, mb, d) for mb in plans] for d in range(self.dp_size)]
        for r in range(1, self.world_size):
            send_shares(per_dp[self.dp_rank_of(r)], r, self.device)
        return per_dp[self.dp_rank_of(self.rank)]

    def _rank_share(self, trajs: list[Trajectory], adv: torch.Tensor, mb: Minibatch, dp_rank: int) -> Share:
        """Trajectories dp_rank, dp_rank + D, ... of every micro-batch of `mb`, collated; where that is none,
        its first trajectory with nothing trained (weight 0)."""
        micros, tokens = [], []
        for index in mb.micros:
            rows = index[dp_rank::self.dp_size]
            batch = self._collate(trajs, adv, mb, rows or index[:1])
            if not rows:
                batch.loss_mask = torch.zeros_like(batch.loss_mask)
                batch.loss_weights = torch.zeros_like(batch.loss_weights)
            micros.append(batch.to(self.device))
            tokens.append(sum(trained_tokens(trajs[i]) for i in rows))
        return Share(total=mb.tokens, micros=micros, tokens=tokens)

    def _load_shard(self, path: str) -> dict[str, Any]:
        """This rank's part of the checkpoint at `path` (weights, optimizer state); returns its meta."""
        raise NotImplementedError

    def load_checkpoint(self, path: str) -> dict[str, Any]:
        """Collective: weights, optimizer state, version and RNG of a checkpoint; returns its meta.

        Every rank reads the files itself and keeps its own part, so the checkpoint must be on
        a file system every rank sees. Every rank restores the same RNG. The ranks then agree:
        if any could not load, all raise.
        """
        error: Exception | None = None
        meta: dict[str, Any] = {}
        try:
            meta = self._load_shard(path)
            if "policy_version" not in meta:
                raise ValueError(f"{path}/meta.json: has no policy_version (not a trainer checkpoint)")
        except Exception as exc:  # noqa: BLE001 -- whatever it was, the other ranks must not wait for this one
            error = exc
        failed = torch.zeros(self.world_size, dtype=torch.int32, device=self.device)
        failed[self.rank] = int(error is not None)
        dist.all_reduce(failed, op=dist.ReduceOp.SUM)
        if error is not None:
            raise error
        if bad := [r for r, f in enumerate(failed.tolist()) if f]:
            raise RuntimeError(f"trainer.resume: trainer rank(s) {bad} could not load checkpoint {path} (see their "
                               "logs); every rank reads it itself, so run_dir must be on a file system all ranks see")
        self.policy_version = int(meta["policy_version"])
        if "rng" in meta:
            self.set_rng_state(meta["rng"])
        logger.info("%s rank %d/%d: loaded its part of %s (policy version %d)", self.cfg.backend, self.rank,
                    self.world_size, path, self.policy_version)
        return meta

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
        # A gloo worker thread drops a finished collective's tensors only once it holds the GIL; one
        # still waiting for it when the interpreter exits aborts the process (exit code -6). Let it.
        time.sleep(_GLOO_DRAIN_S)

    def _stats_result(self, acc: StatsAccumulator) -> dict[str, float]:
        """Weighted sums, their weights, totals and maxima of the data-parallel ranks combined; all ran the
        same stat keys (the gradient norms are already global)."""
        acc.read()
        keys, total_keys, max_keys = sorted(acc.sums), sorted(acc.totals), sorted(acc.maxes)
        sums = torch.tensor([acc.sums[k] for k in keys] + [acc.weights[k] for k in keys]
                            + [acc.totals[k] for k in total_keys] + [0.0], dtype=torch.float64, device=self.device)
        maxes = torch.tensor([acc.maxes[k] for k in max_keys] or [0.0], dtype=torch.float64, device=self.device)
        dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=self.stats_group)
        dist.all_reduce(maxes, op=dist.ReduceOp.MAX, group=self.stats_group)
        flat = sums.tolist()
        acc.sums = dict(zip(keys, flat[:len(keys)]))
        acc.weights = dict(zip(keys, flat[len(keys):2 * len(keys)]))
        acc.totals = dict(zip(total_keys, flat[2 * len(keys):2 * len(keys) + len(total_keys)]))
        acc.maxes = dict(zip(max_keys, maxes.tolist()))
        return acc.result()


# ---------------------------------------------------------------------- devices and the process group
def _visible_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def check_ranks(cfg: TrainerConfig) -> torch.device:
    """Fail before any process starts if this machine cannot hold `trainer.world_size` CPU ranks
    (GPUs for CUDA ranks are counted where they are placed: async_rl/placement.py); the device."""
    device = resolve_device(cfg.device, "trainer.device")
    n = cfg.world_size
    if device.type == "cpu" and n > _visible_cores():
        raise ValueError(f"trainer.world_size: {n} CPU ranks need at least {n} cores (one thread each), "
                         f"but this machine has {_visible_cores()}")
    return device


def join_group(cfg: Config, rank: RankInfo, name: str) -> torch.device:
    """Join the trainer's process group (gloo on CPU, NCCL on CUDA) on this rank's device; return it."""
    if rank.world_size != cfg.trainer.world_size:
        raise ValueError(f"trainer.world_size: config says {cfg.trainer.world_size}, "
                         f"launcher started {rank.world_size} ranks")
    if rank.store is None:
        raise ValueError(f"trainer.backend={name}: ranks need a shared store (start them with trainer_rank_main)")
    device = resolve_device(cfg.trainer.device, "trainer.device")  # this rank's own: its launcher placed it
    if device.type == "cuda" and device.index is None and rank.world_size > 1:
        raise ValueError(f"trainer.device: {cfg.trainer.device!r} names no GPU for rank {rank.rank}; each rank "
                         "builds with its own (async_rl.placement.rank_device)")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                store=dist.PrefixStore(name, rank.store), rank=rank.rank,
                                world_size=rank.world_size, timeout=timedelta(seconds=rank.timeout_s),
                                device_id=device if device.type == "cuda" else None)
    return device
