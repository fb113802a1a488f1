"""Trainer backends, chosen by `trainer.backend`: how many processes train and how weights are laid out.

    spec = TRAINER_BACKENDS[cfg.trainer.backend]
    spec.check(cfg)                                # before any process starts: world size vs CPU cores, ...
    trainer = spec.build(cfg, RankInfo(rank, world_size, store))   # on every rank, in lock step

- `single`: today's `PPOTrainer`, one process (CPU or one GPU); `trainer.world_size` must be 1.
- `fsdp`: FSDP2 (`fully_shard`) over `trainer.world_size` processes, gloo on CPU, NCCL on CUDA
  (each rank on the GPU placement gave it: async_rl/placement.py). Data parallel: every rank
  runs its share of each micro-batch, gradients are summed by FSDP's reduce-scatter, so a
  step equals the single-process step.
- `megatron`: a Megatron-core GPTModel, `trainer.tensor_parallel` x data parallel over
  `trainer.world_size` processes, converted from and to the HF model (megatron.py).

Rank 0 of a multi-process backend alone gets the trajectories (`train_step`); the others
call `follow_train_step()` and receive their rows over the process group (spmd.py).

A built trainer is SPMD: every rank calls the same methods in the same order (the launch
layer forwards rank 0's calls to the other ranks). `state_dict()`, `weights()`, `save_checkpoint()` and
`load_checkpoint()` are collective; rank 0 gets the full weights, the other ranks an empty dict;
on load every rank reads the checkpoint itself and keeps its own shard (backends/scatter.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from async_rl.config import Config
from async_rl.types import Trajectory
from async_rl.utils.weights import WeightSource
from async_rl.utils.hardware import DtypeChoice, resolve_device, resolve_dtype


@dataclass(frozen=True, slots=True)
class RankInfo:
    """Where this process sits in the trainer's process group."""

    rank: int = 0
    world_size: int = 1
    store: Any = None  # a torch.distributed Store shared by the ranks (None for one process)
    local_rank: int | None = None  # device index of this rank in its process's GPU pool (default: rank);
    # the launch layer turns it into the rank's `trainer.device` (async_rl.placement.rank_device)
    timeout_s: float = 60.0  # a collective that waits longer than this fails instead of hanging


class TrainerBackend(Protocol):
    """What the trainer process drives; `policy_version` counts train steps."""

    policy_version: int

    def train_step(self, groups: list[list[Trajectory]]) -> dict[str, float]: ...

    def state_dict(self) -> dict[str, torch.Tensor]: ...

    def weights(self) -> WeightSource:
        """The weights to publish, read from the parameters tensor by tensor (collective on FSDP)."""
        ...

    def save_checkpoint(self, path: str, step: int, extra: dict[str, Any]) -> None: ...

    def load_checkpoint(self, path: str) -> dict[str, Any]: ...

    def close(self) -> None: ...


@dataclass(frozen=True, slots=True)
class BackendSpec:
    check: Callable[[Config], None]  # raise ValueError naming the key if this machine or model cannot run it
    build: Callable[[Config, RankInfo], TrainerBackend]
    distributed: bool  # ranks join a process group (they need RankInfo.store, even for one rank)
    # trainer.compute_dtype (auto | float32 | bfloat16) on a device -> the dtype this backend computes in, and why
    compute_dtype: Callable[[str, torch.device], DtypeChoice] = resolve_dtype


def train_staleness(cfg: Config) -> int:
    """The staleness bound the trainer enforces: 0 in sync mode (lock step), else max_staleness."""
    return 0 if cfg.mode == "sync" else cfg.max_staleness


def trainer_config(cfg: Config) -> TrainerConfig:
    """`cfg.trainer` with what it takes from the rest of the config filled in: loss_agg_tokens 0 is
    the generation budget, rollout.max_new_tokens; lr_decay_steps 0 is the run's total_steps."""
    return dataclasses.replace(cfg.trainer, loss_agg_tokens=cfg.trainer.loss_agg_tokens or cfg.rollout.max_new_tokens,
                               lr_decay_steps=cfg.trainer.lr_decay_steps or cfg.total_steps)


def check_single(cfg: Config) -> None:
    if cfg.trainer.world_size != 1:
        raise ValueError(f"trainer.world_size: the single backend runs one process, got {cfg.trainer.world_size}; "
                         "use trainer.backend=fsdp or megatron to train on several")
    resolve_device(cfg.trainer.device, "trainer.device")


def _build_single(cfg: Config, rank: RankInfo) -> TrainerBackend:
    from async_rl.trainer.backends import single

    return single.build(cfg, rank)


def _single() -> BackendSpec:
    # the launcher checks the config and picks the dtype with it: neither imports the trainer (tensordict
    # brings in torch._dynamo, ~2.5 s before any process could start)
    return BackendSpec(check=check_single, build=_build_single, distributed=False)


def _fsdp() -> BackendSpec:
    from async_rl.trainer.backends import fsdp

    return BackendSpec(check=fsdp.check, build=fsdp.build, distributed=True)


def _megatron() -> BackendSpec:
    from async_rl.trainer.backends import megatron

    return BackendSpec(check=megatron.check, build=megatron.build, distributed=True,
                       compute_dtype=megatron.compute_dtype)


# imported lazily: fsdp pulls in torch.distributed, megatron megatron-core (an optional extra), only when chosen
TRAINER_BACKENDS: dict[str, Callable[[], BackendSpec]] = {"single": _single, "fsdp": _fsdp, "megatron": _megatron}


def get_backend(name: str) -> BackendSpec:
    if name not in TRAINER_BACKENDS:
        raise ValueError(f"trainer.backend: must be one of {'|'.join(TRAINER_BACKENDS)}, got {name!r}")
    return TRAINER_BACKENDS[name]()
