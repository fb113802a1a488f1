"""The `fsdp` trainer backend: PPO on FSDP2 (`fully_shard`) across `trainer.world_size` processes.

    trainer = build(cfg, RankInfo(rank, world_size, store))   # on every rank; joins the process group
    stats = trainer.train_step(groups)                         # every rank, the same groups
    weights = trainer.state_dict()                             # every rank; full on rank 0, {} elsewhere
    meta = trainer.load_checkpoint(path)                       # every rank reads its own shard of the files

Each decoder layer is one FSDP unit and the rest (embedding, final norm, the tied LM head)
is the root unit. The root is a small module whose forward is the whole log-prob
computation (`token_logprobs`), so every weight is gathered inside an FSDP forward.

Data parallel: every rank builds the same minibatches and micro-batches as the single
process (same seed, same batch), then runs rows r, r+W, r+2W, ... of each micro-batch.
Each token's term carries its weight in the minibatch's loss (`Batch.loss_weights`,
computed before the rows are split), so a rank's loss is its rows' part of that sum; FSDP
sums the ranks' gradients (divide factor 1), which gives exactly the single-process gradient.
Every rank runs every micro-batch's forward and backward, an empty share as a
zero-weight pass over one token, so the collectives stay in lock step.

Device: gloo on CPU, NCCL on CUDA with each rank on the device its launcher placed it on
(`trainer.device` of the config it builds with; async_rl/placement.py).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

from async_rl.config import Config, TrainerConfig
from async_rl.models import load_model, load_tokenizer
from async_rl.trainer.backends import RankInfo, train_staleness, trainer_config
from async_rl.trainer.backends.gather import gather_optimizer_state, gather_state_dict
from async_rl.trainer.backends.scatter import load_sharded
from async_rl.trainer.batching import Batch, token_logprobs
from async_rl.trainer.checkpoint import hf_exporter, save_checkpoint
from async_rl.trainer.stats import StatsAccumulator
from async_rl.trainer.trainer import PPOTrainer
from async_rl.utils.hardware import resolve_device

logger = logging.getLogger(__name__)

_GLOO_DRAIN_S = 0.05  # see FSDPTrainer.close


class LogprobModel(torch.nn.Module):
    """FSDP root: token ids -> [B, L-1] log-probs of the scored tokens (see `token_logprobs`)."""

    def __init__(self, lm: torch.nn.Module, temperature: float):
        super().__init__()
        self.lm = lm
        self.temperature = temperature

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                score_mask: torch.Tensor) -> torch.Tensor:
        return token_logprobs(self.lm, input_ids, attention_mask, self.temperature, score_mask=score_mask)


class FSDPTrainer(PPOTrainer):
    """PPOTrainer whose model is sharded over the default process group; see the module docstring."""

    def __init__(self, root: LogprobModel, cfg: TrainerConfig, **kwargs: Any):
        super().__init__(root, cfg, temperature=root.temperature, **kwargs)
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()

    # ------------------------------------------------------------------ backend interface
    def state_dict(self) -> dict[str, torch.Tensor]:
        """Collective: full CPU weights named as the HF model's state_dict() on rank 0, {} elsewhere."""
        return gather_state_dict(self.model.lm)

    def save_checkpoint(self, path: str, step: int, extra: dict[str, Any]) -> None:
        """Collective: rank 0 writes the same checkpoint layout as the single backend (full tensors)."""
        weights = gather_state_dict(self.model.lm)
        optim = gather_optimizer_state(self.optimizer)
        if self.rank == 0:
            save_checkpoint(path, weights, optim, step, extra, hf_export=self.hf_export)
        dist.barrier()

    def load_checkpoint(self, path: str) -> dict[str, Any]:
        """Collective: weights, optimizer state, version and RNG of a checkpoint (full tensors, as this
        backend or the single one writes it); returns its meta.

        Every rank reads the files itself and keeps its own shard (see scatter.py), so the
        checkpoint must be on a file system every rank sees. Every rank restores the same RNG
        (all draw the same minibatch split). The ranks then agree: if any could not load, all raise.
        """
        error: Exception | None = None
        meta: dict[str, Any] = {}
        try:
            meta = load_sharded(path, self.model.lm, self.optimizer)
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
        logger.info("fsdp rank %d/%d: loaded its shard of %s (policy version %d)", self.rank, self.world_size,
                    path, self.policy_version)
        return meta

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
        # A gloo worker thread drops a finished collective's tensors only once it holds the GIL; one
        # still waiting for it when the interpreter exits aborts the process (exit code -6). Let it.
        time.sleep(_GLOO_DRAIN_S)

    # ------------------------------------------------------------------ PPOTrainer seams
    def _logprobs(self, batch: Batch) -> torch.Tensor:
        score = batch.loss_mask
        if batch.num_tokens == 0:  # an empty share: score one real position so every weight sees a backward
            score = torch.zeros_like(batch.loss_mask)
            score[0, 0] = 1.0
        with self._autocast():
            return self.model(batch.input_ids, batch.attention_mask, score)

    def _local_share(self, micros: list[Batch]) -> list[Batch]:
        """Rows rank, rank+W, ... of every non-empty micro-batch; row 0 unscored where that is nothing."""
        out = []
        for b in micros:
            if not b.num_tokens:
                continue
            rows = list(range(self.rank, b.input_ids.shape[0], self.world_size))
            if rows:
                out.append(_rows(b, rows))
            else:
                idle = _rows(b, [0])
                out.append(dataclasses.replace(idle, loss_mask=torch.zeros_like(idle.loss_mask),
                                               loss_weights=torch.zeros_like(idle.loss_weights)))
        return out

    def _stats_result(self, acc: StatsAccumulator) -> dict[str, float]:
        """Weighted sums, their weights, totals and maxima of every rank combined; every rank ran the same
        stat keys (the gradient norms are already global)."""
        keys, total_keys, max_keys = sorted(acc.sums), sorted(acc.totals), sorted(acc.maxes)
        sums = torch.tensor([acc.sums[k] for k in keys] + [acc.weights[k] for k in keys]
                            + [acc.totals[k] for k in total_keys] + [0.0], dtype=torch.float64, device=self.device)
        maxes = torch.tensor([acc.maxes[k] for k in max_keys] or [0.0], dtype=torch.float64, device=self.device)
        dist.all_reduce(sums, op=dist.ReduceOp.SUM)
        dist.all_reduce(maxes, op=dist.ReduceOp.MAX)
        flat = sums.tolist()
        acc.sums = dict(zip(keys, flat[:len(keys)]))
        acc.weights = dict(zip(keys, flat[len(keys):2 * len(keys)]))
        acc.totals = dict(zip(total_keys, flat[2 * len(keys):2 * len(keys) + len(total_keys)]))
        acc.maxes = dict(zip(max_keys, maxes.tolist()))
        return acc.result()

    def _clip_grads(self) -> float:
        max_norm = self.cfg.grad_clip if self.cfg.grad_clip > 0 else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(self.params, max_norm)
        return float(norm.full_tensor() if isinstance(norm, DTensor) else norm)


def _rows(b: Batch, rows: list[int]) -> Batch:
    idx = torch.tensor(rows, device=b.input_ids.device)
    return Batch(input_ids=b.input_ids[idx], attention_mask=b.attention_mask[idx], loss_mask=b.loss_mask[idx],
                 behav_logprobs=b.behav_logprobs[idx], versions=b.versions[idx], advantages=b.advantages[idx],
                 loss_weights=b.loss_weights[idx], index=[b.index[r] for r in rows])


# ---------------------------------------------------------------------- devices and build
def _visible_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def check(cfg: TrainerConfig) -> None:
    """Fail before any process starts if this machine cannot hold `trainer.world_size` CPU ranks
    (GPUs for CUDA ranks are counted where they are placed: async_rl/placement.py)."""
    if cfg.kl_coef > 0:
        raise ValueError(f"trainer.kl_coef: the fsdp backend keeps no reference model yet (got {cfg.kl_coef}); "
                         "use trainer.backend=single, or trainer.kl_coef=0")
    device = resolve_device(cfg.device, "trainer.device")
    n = cfg.world_size
    if device.type == "cpu" and n > _visible_cores():
        raise ValueError(f"trainer.world_size: {n} CPU ranks need at least {n} cores (one thread each), "
                         f"but this machine has {_visible_cores()}")


def build(cfg: Config, rank: RankInfo) -> FSDPTrainer:
    """Join the process group (gloo on CPU, NCCL on CUDA), shard the model, return this rank's trainer."""
    if rank.world_size != cfg.trainer.world_size:
        raise ValueError(f"trainer.world_size: config says {cfg.trainer.world_size}, "
                         f"launcher started {rank.world_size} ranks")
    if rank.store is None:
        raise ValueError("trainer.backend=fsdp: ranks need a shared store (start them with trainer_rank_main)")
    device = resolve_device(cfg.trainer.device, "trainer.device")  # this rank's own: its launcher placed it
    if device.type == "cuda" and device.index is None and rank.world_size > 1:
        raise ValueError(f"trainer.device: {cfg.trainer.device!r} names no GPU for rank {rank.rank}; each rank "
                         "builds with its own (async_rl.placement.rank_device)")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                store=dist.PrefixStore("fsdp", rank.store), rank=rank.rank,
                                world_size=rank.world_size, timeout=timedelta(seconds=rank.timeout_s),
                                device_id=device if device.type == "cuda" else None)
    mesh = init_device_mesh(device.type, (rank.world_size,))
    # every rank builds the same initial weights from the seed, then keeps only its shard
    lm = load_model(dataclasses.replace(cfg.model, dtype="float32"), seed=cfg.seed, device=device)
    root = LogprobModel(lm, cfg.rollout.temperature)
    for layer in getattr(lm.get_decoder(), "layers", []):
        fully_shard(layer, mesh=mesh)
    fully_shard(root, mesh=mesh)
    assert isinstance(root, FSDPModule)
    for module in root.modules():
        if isinstance(module, FSDPModule):
            # sum the ranks' gradients (shares are token-sum weighted) with a plain SUM: gloo has no PREMUL_SUM
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
    logger.info("fsdp rank %d/%d on %s: %d FSDP units", rank.rank, rank.world_size, device,
                sum(isinstance(m, FSDPModule) for m in root.modules()))
    trainer = FSDPTrainer(root, trainer_config(cfg), max_staleness=train_staleness(cfg), seed=cfg.seed)
    if rank.rank == 0:  # the rank that writes checkpoints also makes them Hugging Face model directories
        trainer.hf_export = hf_exporter(lm.config, load_tokenizer(cfg.model))
    return trainer
