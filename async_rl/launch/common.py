"""Small pieces every launcher needs: thread counts, free ports, one-line fatal errors, GPU placement here."""

from __future__ import annotations

import os
import dataclasses
import logging
from pathlib import Path

import torch

from async_rl.config import Config
from async_rl.placement import SIDES, Placement, gpus_here, place
from async_rl.trainer.backends import get_backend
from async_rl.utils.cores import CoreShare, base_share
from async_rl.utils.hardware import resolve_device, resolve_dtype
from async_rl.utils.ports import free_port

logger = logging.getLogger(__name__)


def effective_threads(configured: int, mode: str) -> int:
    """Torch threads for one process on this machine (utils/cores.py: base_share)."""
    return base_share(configured, mode, os.cpu_count() or 1)


def with_free_port(addr: str) -> str:
    """tcp://HOST:0 -> tcp://HOST:<free port>; anything else unchanged."""
    if addr.startswith("tcp://") and addr.endswith(":0"):
        host = addr[len("tcp://"):-2]
        return f"tcp://{host}:{free_port(host)}"
    return addr


def up_file(run_dir: str | Path, name: str) -> Path:
    """Exists once process `name` of this launch got through its start (see `mark_up`)."""
    return Path(run_dir) / "logs" / f"{name}.up"


def mark_up(run_dir: str | Path, name: str) -> None:
    """Process `name` is up (model built, queue bound or joined). A process that dies before its
    first launch got this far failed on what it was given, and the launcher does not restart it."""
    path = up_file(run_dir, name)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.touch()


def pin_dtypes(cfg: Config, command: str) -> tuple[Config, list[str]]:
    """Resolve `auto` dtypes once, here, so every local process computes in the same dtype.

    Returns the config with explicit dtypes and the lines that tell the user what was chosen
    and why (the engine's weights, the trainer's autocast)."""
    lines = []
    model, trainer = cfg.model, cfg.trainer
    if command in ("run", "rollout", "serve"):
        choice = resolve_dtype(model.dtype, resolve_device(cfg.engine.device, "engine.device"))
        model = dataclasses.replace(model, dtype=choice.name)
        lines.append(f"engine dtype: {choice.name} ({choice.reason})")
    if command in ("run", "train"):
        choice = get_backend(trainer.backend).compute_dtype(trainer.compute_dtype,
                                                            resolve_device(trainer.device, "trainer.device"))
        trainer = dataclasses.replace(trainer, compute_dtype=choice.name)
        lines.append(f"trainer compute dtype: {choice.name} ({choice.reason}; master weights fp32)")
    return dataclasses.replace(cfg, model=model, trainer=trainer), lines


def place_here(cfg: Config, sides: tuple[str, ...] = SIDES) -> Placement:
    """Place the pools of `sides` on this machine's GPUs (async_rl/placement.py) and say where, before
    any process starts: what cannot be placed raises a ConfigError naming the key."""
    visible, mask = gpus_here()
    plan = place(cfg, visible=visible, mask=mask, sides=sides)
    for line in plan.lines:
        logger.info("%s", line)
        print(line, flush=True)
    return plan


def cap_gpu_memory(device: str, fraction: float) -> None:
    """Hold this process to `fraction` of its GPU's memory (0 = no cap): the two sides of a GPU that
    trainer and engine share each keep to their part of the split."""
    if fraction > 0 and device.startswith("cuda"):
        torch.cuda.set_per_process_memory_fraction(fraction, torch.device(device))
        logger.info("GPU memory: this process keeps to %.0f%% of %s", 100 * fraction, device)


def check_agents(cfg: Config, prepare: bool) -> None:
    """Before any process starts: `agent.modules` import, the tools and interactions YAML load, and
    every agent loop and interaction the task's samples name is registered. One clear error here,
    instead of a rollout process that fails after loading its model and is restarted in vain. What
    tools need of a machine (`BaseTool.prepare`: the python tool's isolation) is checked where the
    rollout side runs: here with `prepare` (it runs on this machine), else by the rollout process."""
    from async_rl.agent import build_agent_context, check_agent_names
    from async_rl.tasks import build_task

    check_agent_names(build_agent_context(cfg.agent, prepare=prepare), cfg.rollout.agent,
                      build_task(cfg.task).names_used())


def pin_to_pool(cfg: Config, role: str) -> list[int]:
    """Pin this process to its side's pool of CPUs (`cores.engine` for the rollout side's processes,
    `cores.trainer` for the trainer's), if one is configured; return the pool."""
    key = "trainer" if role == "trainer" else "engine"
    pool = cfg.cores.trainer if key == "trainer" else cfg.cores.engine
    if pool:
        try:
            os.sched_setaffinity(0, pool)
        except (OSError, ValueError) as exc:
            raise ValueError(f"cores.{key}: cannot pin to CPUs {pool} ({exc})") from None
        logger.info("%s pinned to CPUs %s", role, pool)
    return pool


def setup_cores(cfg: Config, role: str) -> CoreShare | None:
    """CPU cores of this process (`role`: engine | trainer).

    A pool (`cores.engine` / `cores.trainer` lists) pins the process to those CPUs, as separate
    GPU pools are separate; otherwise the process gets its configured threads and, with
    `cores.share`, borrows the cores of local processes that are waiting (see utils/cores.py)."""
    pool = pin_to_pool(cfg, role)
    if pool:
        torch.set_num_threads(len(pool))
        return None
    configured = cfg.engine.num_threads if role == "engine" else cfg.trainer.num_threads
    threads = effective_threads(configured, cfg.mode)
    torch.set_num_threads(threads)
    device = resolve_device(cfg.engine.device if role == "engine" else cfg.trainer.device, f"{role}.device")
    if not cfg.cores.share or device.type != "cpu":  # a GPU process leaves the CPU cores alone
        return None
    return CoreShare.claim(Path(cfg.run_dir) / ".cores", share=threads)
