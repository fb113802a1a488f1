"""The trainer process: the ranks, cores and GPU share around `TrainerLoop` (async_rl/trainer/loop.py).

    trainer_main(cfg)                                                    # local launch, `async-rl train`
    trainer_rank_main(cfg, rank, world_size, master_addr, master_port)   # a launcher that starts every rank

The trainer backend (`trainer.backend`) may run `trainer.world_size` ranks. Rank 0 owns
the queue, metrics, checkpoints and publishing (the loop); ranks 1..N-1 only train, following
rank 0 in lock step (async_rl/launch/trainer_ranks.py). `trainer_main` is rank 0 and starts
ranks 1..N-1 as its own child processes; a launcher that places ranks itself (Ray) calls
`trainer_rank_main` once per rank with the same master address and port, where rank 0
will host the rendezvous store. A rank's device comes from async_rl.placement: in a trainer
process given a pool of GPUs (`trainer.device=cuda`) rank r takes the r-th (`local_rank`
overrides r); a rank given its own GPU (Ray: `cuda:0`) takes that one.
"""

from __future__ import annotations

from pathlib import Path

import torch

from async_rl.config import Config
from async_rl.launch.common import cap_gpu_memory, mark_up, setup_cores
from async_rl.launch.trainer_ranks import follower_main, lead, local_followers, rank_threads
from async_rl.trainer.loop import TrainerLoop


def trainer_main(cfg: Config, gpu_memory_fraction: float = 0.0) -> None:
    """Rank 0 on this machine; ranks 1..trainer.world_size-1 run as its child processes.
    `gpu_memory_fraction`: the trainer's part of a GPU it shares with the engine (placement; 0 = all)."""
    cap_gpu_memory(cfg.trainer.device, gpu_memory_fraction)
    with local_followers(cfg) as (master_addr, master_port, check_followers):
        trainer_rank_main(cfg, 0, cfg.trainer.world_size, master_addr, master_port,
                          check_followers=check_followers)


def trainer_rank_main(cfg: Config, rank: int, world_size: int, master_addr: str, master_port: int,
                      local_rank: int | None = None, check_followers=None) -> None:
    """One trainer rank; returns when rank 0 has trained `total_steps` steps (or raises)."""
    if cfg.agent.modules:  # a user's module may register a loss or an advantage estimator the trainer looks up
        from async_rl.agent.base import import_agent_modules

        import_agent_modules(list(cfg.agent.modules))
    if rank > 0:
        follower_main(cfg, rank, world_size, master_addr, master_port, local_rank)
        return
    torch.manual_seed(cfg.seed)
    cores = setup_cores(cfg, "trainer")  # a pool, or a share of this machine's cores lent while we wait
    if world_size > 1:  # ranks split the trainer's threads and train in lock step: nothing to lend
        cores = None
        torch.set_num_threads(rank_threads(cfg, world_size))
    trainer = lead(cfg, world_size, master_addr, master_port, local_rank, check_followers)
    try:
        TrainerLoop(cfg, trainer, cores=cores, handle_sigterm=True,  # the launcher's drain (local.py)
                    on_ready=lambda: mark_up(Path(cfg.run_dir), "trainer")).run()
    finally:
        trainer.close()
