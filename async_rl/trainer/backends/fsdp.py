"""The `fsdp` trainer backend: PPO on FSDP2 (`fully_shard`) across `trainer.world_size` processes.

    trainer = build(cfg, RankInfo(rank, world_size, store))   # on every rank; joins the process group
    stats = trainer.train_step(groups)                         # rank 0; the others: follow_train_step()
    weights = trainer.state_dict()                             # every rank; full on rank 0, {} elsewhere
    source = trainer.weights()                                 # every rank; rank 0 publishes it bucket by bucket
    meta = trainer.load_checkpoint(path)                       # every rank reads its own shard of the files

Each decoder layer is one FSDP unit and the rest (embedding, final norm, the tied LM head)
is the root unit. The root is a small module whose forward is the whole log-prob
computation (`token_logprobs`), so every weight is gathered inside an FSDP forward.

Data parallel: rank 0 builds the minibatches and micro-batches the single process would
(same seed, same batch) and sends rank r rows r, r+W, r+2W, ... of each micro-batch over
the process group (spmd.py). Each token's term carries its weight in the minibatch's loss
(`Batch.loss_weights`, computed before the rows are split), so a rank's loss is its rows'
part of that sum; FSDP sums the ranks' gradients (divide factor 1), which gives exactly the
single-process gradient. Every rank runs every micro-batch's forward and backward, an
empty share as a zero-weight pass over one token, so the collectives stay in lock step.

Device: gloo on CPU, NCCL on CUDA with each rank on the device its launcher placed it on
(`trainer.device` of the config it builds with; async_rl/placement.py).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

from async_rl.config import Config, TrainerConfig
from async_rl.models import load_model, load_tokenizer
from async_rl.trainer.backends import RankInfo, train_staleness, trainer_config
from async_rl.trainer.backends.gather import gather_optimizer_state, gather_state_dict, gathered_weights
from async_rl.trainer.backends.scatter import load_sharded
from async_rl.trainer.backends.spmd import SPMDTrainer, check_ranks, join_group
from async_rl.trainer.checkpoint import hf_exporter, save_checkpoint
from async_rl.trainer.logprobs import token_logprobs
from async_rl.utils.weights import WeightSource

logger = logging.getLogger(__name__)

class LogprobModel(torch.nn.Module):
    """FSDP root: token ids -> [B, L-1] log-probs of the scored tokens (see `token_logprobs`)."""

    def __init__(self, lm: torch.nn.Module, temperature: float):
        super().__init__()
        self.lm = lm
        self.temperature = temperature

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, score_mask: torch.Tensor | None,
                position_ids: torch.Tensor | None = None,
                entropy: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        return token_logprobs(self.lm, input_ids, attention_mask, self.temperature, score_mask=score_mask,
                              position_ids=position_ids, entropy=entropy)


class FSDPTrainer(SPMDTrainer):
    """PPOTrainer whose model is sharded over the default process group; see the module docstring.
    Every rank is a data-parallel rank of its own (rank 0 sends the others their rows: spmd.py)."""

    def __init__(self, root: LogprobModel, cfg: TrainerConfig, store: Any = None, **kwargs: Any):
        super().__init__(root, cfg, temperature=root.temperature, **kwargs)
        self.rank = dist.get_rank()
        self.world_size = self.dp_size = dist.get_world_size()
        self.store = store  # the ranks' store: `weights` paces the other ranks through it
        self._publishes = 0

    def dp_rank_of(self, rank: int) -> int:
        return rank

    # ------------------------------------------------------------------ backend interface
    def state_dict(self) -> dict[str, torch.Tensor]:
        """Collective: full CPU weights named as the HF model's state_dict() on rank 0, {} elsewhere."""
        return gather_state_dict(self.model.lm)

    def weights(self) -> WeightSource:
        """Collective: the weights as a lazy source, gathered tensor by tensor while rank 0 publishes (each
        rank calls it; the others then `close()` it, which gathers every tensor in order)."""
        self._publishes += 1
        source = gathered_weights(self.model.lm, self.store, f"weights/{self._publishes}")
        if self.rank == 0 and self._publishes > 1:  # every rank has passed the last publish's keys: its gathers ended
            for i in range(len(source.names)):
                self.store.delete_key(f"weights/{self._publishes - 1}/{i}")
        return source

    def save_checkpoint(self, path: str, step: int, extra: dict[str, Any]) -> None:
        """Collective: rank 0 writes the same checkpoint layout as the single backend (full tensors)."""
        weights = gather_state_dict(self.model.lm)
        optim = gather_optimizer_state(self.optimizer)
        if self.rank == 0:
            save_checkpoint(path, weights, optim, step, extra, hf_export=self.hf_export)
        dist.barrier()

    def _load_shard(self, path: str) -> dict[str, Any]:
        """This rank's shard of a checkpoint of full tensors (as this backend or the single one writes it)."""
        return load_sharded(path, self.model.lm, self.optimizer)

    # ------------------------------------------------------------------ PPOTrainer seams
    def _score(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, position_ids: torch.Tensor | None,
               score: torch.Tensor | None, entropy: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        return self.model(input_ids, attention_mask, score, position_ids, entropy)

    def _clip_grads(self) -> float:
        max_norm = self.cfg.grad_clip if self.cfg.grad_clip > 0 else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(self.params, max_norm)
        return float(norm.full_tensor() if isinstance(norm, DTensor) else norm)


# ---------------------------------------------------------------------- devices and build
def check(cfg: Config) -> None:
    if cfg.trainer.kl_coef > 0:
        raise ValueError(f"trainer.kl_coef: the fsdp backend keeps no reference model yet (got "
                         f"{cfg.trainer.kl_coef}); use trainer.backend=single, or trainer.kl_coef=0")
    check_ranks(cfg.trainer)


def build(cfg: Config, rank: RankInfo) -> FSDPTrainer:
    """Join the process group (gloo on CPU, NCCL on CUDA), shard the model, return this rank's trainer."""
    device = join_group(cfg, rank, "fsdp")
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
    trainer = FSDPTrainer(root, trainer_config(cfg), store=rank.store, max_staleness=train_staleness(cfg),
                          seed=cfg.seed)
    if rank.rank == 0:  # the rank that writes checkpoints also makes them Hugging Face model directories
        trainer.hf_export = hf_exporter(lm.config, load_tokenizer(cfg.model))
    return trainer
