"""The run-wide sections (how the two sides talk, where the processes run, how they are supervised, what
is logged) and `Config`, the whole run: the frozen top-level keys and one section per component.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from async_rl.config.components import (
    AgentConfig,
    EngineConfig,
    ModelConfig,
    RolloutConfig,
    TaskConfig,
    TrainerConfig,
)


@dataclass
class TransportConfig:
    """The trajectory queue between the two sides: address, capacity, liveness, authentication."""

    addr: str = "tcp://127.0.0.1:0"  # trainer binds here, rollout connects (port 0 = free port, local run only)
    capacity: int = 256  # trajectories the trainer buffers; a full buffer blocks producers
    heartbeat_s: float = 2.0  # keep-alive interval between rollout and trainer
    peer_timeout_s: float = 60.0  # a silent peer for this long is reported dead
    rejoin_timeout_s: float = 120.0  # the trainer waits this long for a lost rollout side to come back (0 = fail)
    # CURVE keys of the queue (and so of the zmq weight channel on it), from `async-rl keys --out DIR`:
    # encrypted, and only producers whose key is in DIR/authorized_clients get in; "" = no auth, which
    # a queue bound to an address other machines reach refuses at start-up (async_rl/exposure.py)
    curve_keys_dir: str = ""
    insecure: bool = False  # true: bind such an address without keys all the same (a private network), loudly


@dataclass
class WeightSyncConfig:
    """How a new weight version travels from the trainer to the generation servers (async_rl/weight_sync/)."""

    # disk (shared file system) | zmq (buckets over the queue) | dist (torch.distributed)
    transport: Literal["disk", "zmq", "dist"] = "disk"
    keep_last: int = 2  # weight files kept on disk (at least max_staleness + 2, so the rollout never misses one)
    bucket_mb: float = 128.0  # size of one weight bucket (zmq, dist): the most extra memory an update holds
    deadline_s: float = 120.0  # a server that has not loaded an update by then is fenced (out of rotation)


@dataclass
class RayConfig:
    """launcher=ray: the cluster to join and the size of each process's bundle (async_rl/launch/ray_launcher.py)."""

    address: str = ""  # existing cluster (e.g. "auto" or "ray://HOST:10001"); empty = start a local one
    num_cpus_per_server: float = 1.0  # CPU bundle of one generation server
    num_gpus_per_server: float = 0.0  # GPU bundle of one generation server: 0 = auto (1 where the engine runs on CUDA)
    num_cpus_per_trainer: float = 1.0  # CPU bundle of one trainer rank
    num_gpus_per_trainer: float = 0.0  # GPU bundle of one trainer rank: 0 = auto (1 where the trainer runs on CUDA)
    placement_timeout_s: float = 120.0  # a placement group not placed by then is an error naming the resources


@dataclass
class ClusterConfig:
    """Which GPUs each pool uses under launcher=local (async_rl/placement.py). Indices are as this process
    sees them (cuda:i, i.e. positions in an inherited CUDA_VISIBLE_DEVICES); the pools must not overlap,
    except one trainer rank and one server listing the same single GPU (they share it)."""

    trainer_gpus: list[int] = field(default_factory=list)  # one per trainer rank; empty = auto (the first free GPUs)
    rollout_gpus: list[int] = field(default_factory=list)  # one per generation server; empty = auto (after the trainer's)


@dataclass
class CoresConfig:
    """How processes on one machine share its CPU cores (async_rl/utils/cores.py)."""

    share: bool = True  # processes on one machine lend their cores to each other while they wait
    engine: list[int] = field(default_factory=list)  # pin generation servers to these CPU ids (a pool); empty = no pin
    trainer: list[int] = field(default_factory=list)  # pin the trainer to these CPU ids (a pool); empty = no pin


@dataclass
class SuperviseConfig:
    """How `async-rl run` (launcher=local) restarts what crashes and how it stops on SIGTERM (async_rl/launch/local.py)."""

    # restarts per component (the trainer, the rollout process, each generation server) after it dies with
    # a non-zero exit code or a signal; the trainer restarts with trainer.resume=true. 0 = a crash ends the run
    max_restarts: int = 3
    restart_backoff_s: float = 2.0  # wait before a component's first restart, doubled for each further one (<= 60s)
    drain_timeout_s: float = 300.0  # after SIGTERM, how long the trainer may take to finish its step and checkpoint


@dataclass
class LogConfig:
    """What a run logs besides its metrics."""

    level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"  # logging level
    progress: bool = True  # progress bar on the console
    tensorboard: bool = True  # also write TensorBoard events when tensorboard is installed
    trajectories: bool = False  # the trainer writes every trajectory it receives to run_dir/trajectories.jsonl


@dataclass
class Config:
    """A whole run: the frozen top-level keys and one section per component."""

    mode: Literal["async", "sync"] = "async"  # sync = lock step: generate a batch, train, update, repeat
    max_staleness: int = 1  # eta: newest trainable token is at most this many versions behind
    total_steps: int = 20  # train steps of the run
    run_dir: str = "runs/debug"  # where metrics, config, weights and checkpoints go
    seed: int = 0  # seed of everything random
    launcher: Literal["local", "ray"] = "local"  # local (child processes) | ray (placement groups on a Ray cluster)
    model: ModelConfig = field(default_factory=ModelConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    agent: AgentConfig = field(default_factory=AgentConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    transport: TransportConfig = field(default_factory=TransportConfig)
    weight_sync: WeightSyncConfig = field(default_factory=WeightSyncConfig)
    ray: RayConfig = field(default_factory=RayConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    cores: CoresConfig = field(default_factory=CoresConfig)
    supervise: SuperviseConfig = field(default_factory=SuperviseConfig)
    log: LogConfig = field(default_factory=LogConfig)
