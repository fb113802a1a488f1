"""The checks a config's types alone cannot make; each failure is a ConfigError naming the dotted key."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from async_rl.config.components import ConfigError
from async_rl.config.run import Config
from async_rl.config.secrets import CURVE_KEY_FILES, missing_curve_files


def _check_curve_keys(keys_dir: str) -> None:
    """Each process needs only its side's files; a directory holding neither side's is an error."""
    key = "transport.curve_keys_dir"
    if not Path(keys_dir).is_dir():
        raise ConfigError(f"{key}: no directory {keys_dir!r}; make keys with `async-rl keys --out {keys_dir}`")
    missing = {side: missing_curve_files(keys_dir, side) for side in CURVE_KEY_FILES}
    if all(missing.values()):
        raise ConfigError(f"{key}: {keys_dir} lacks {Path(keys_dir) / missing['trainer'][0]} (trainer side) and "
                          f"{Path(keys_dir) / missing['rollout'][0]} (rollout side); make keys with "
                          f"`async-rl keys --out DIR`")


def _get(cfg: Config, dotted: str) -> Any:
    obj: Any = cfg
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def validate(cfg: Config) -> None:
    """Check values the types alone cannot; raise ConfigError naming the key."""
    if cfg.trainer.stale_tokens == "mask" and cfg.rollout.restart_stale:
        raise ConfigError("trainer.stale_tokens=mask trains what a generation sampled within the bound after it ran "
                          "past it, so it needs rollout.restart_stale=false (restarting such a generation leaves "
                          "nothing to mask)")
    if cfg.rollout.truncated_reward is not None and not math.isfinite(cfg.rollout.truncated_reward):
        raise ConfigError(f"rollout.truncated_reward: must be a finite number or null, got {cfg.rollout.truncated_reward}")
    positive = ["total_steps", "rollout.group_size", "rollout.max_new_tokens", "rollout.max_concurrent",
                "trainer.batch_size", "trainer.minibatches", "trainer.micro_batch_tokens",
                "engine.max_running", "engine.max_tokens_per_step", "engine.block_size",
                "transport.capacity", "rollout.stream_interval", "task.eval_size", "rollout.num_servers",
                "trainer.world_size", "engine.tp_size",
                "weight_sync.bucket_mb", "weight_sync.deadline_s", "rollout.health_interval_s",
                "ray.placement_timeout_s", "agent.max_assistant_turns", "agent.max_response_tokens",
                "agent.max_parallel_tool_calls"]
    for key in positive:
        if _get(cfg, key) <= 0:
            raise ConfigError(f"{key}: must be > 0, got {_get(cfg, key)!r}")
    if cfg.task.val_size < 0:
        raise ConfigError(f"task.val_size: must be >= 0, got {cfg.task.val_size}")
    if cfg.rollout.sticky_overload_margin < 0:
        raise ConfigError(f"rollout.sticky_overload_margin: must be >= 0, got {cfg.rollout.sticky_overload_margin}")
    if cfg.agent.max_user_turns < 0 or cfg.rollout.trace_every < 0:
        raise ConfigError("agent.max_user_turns and rollout.trace_every: must be >= 0")
    for key, low in (("supervise.max_restarts", 0), ("supervise.restart_backoff_s", 0),
                     ("trainer.micro_batch_overhead_tokens", 0), ("trainer.checkpoint_every", 0),
                     ("trainer.loss_agg_tokens", 0), ("trainer.kl_coef", 0),
                     ("trainer.lr_warmup_steps", 0), ("trainer.lr_decay_steps", 0), ("trainer.lr_hold_steps", 0),
                     ("trainer.lr_min_ratio", 0),
                     ("trainer.keep_checkpoints", 0), ("rollout.fill_ramp", 0)):
        if _get(cfg, key) < low:
            raise ConfigError(f"{key}: must be >= {low}, got {_get(cfg, key)!r}")
    if not 0 <= cfg.trainer.lr_min_ratio <= 1:
        raise ConfigError(f"trainer.lr_min_ratio: must be in [0, 1], got {cfg.trainer.lr_min_ratio}")
    if not 0 <= cfg.trainer.checkpoint_budget < 1:
        raise ConfigError(f"trainer.checkpoint_budget: must be in [0, 1), got {cfg.trainer.checkpoint_budget}")
    if cfg.supervise.drain_timeout_s <= 0:
        raise ConfigError(f"supervise.drain_timeout_s: must be > 0, got {cfg.supervise.drain_timeout_s}")
    if cfg.max_staleness < 0:
        raise ConfigError(f"max_staleness: must be >= 0, got {cfg.max_staleness}")
    if cfg.trainer.tensor_parallel < 1:
        raise ConfigError(f"trainer.tensor_parallel: must be >= 1, got {cfg.trainer.tensor_parallel}")
    if cfg.trainer.backend != "megatron" and cfg.trainer.tensor_parallel != 1:
        raise ConfigError(f"trainer.tensor_parallel: only trainer.backend=megatron splits tensors, "
                          f"got {cfg.trainer.tensor_parallel} with trainer.backend={cfg.trainer.backend}")
    if cfg.trainer.world_size % cfg.trainer.tensor_parallel:
        raise ConfigError(f"trainer.tensor_parallel: must divide trainer.world_size ({cfg.trainer.world_size}; the "
                          f"rest is data parallel), got {cfg.trainer.tensor_parallel}")
    if cfg.trainer.batch_size % cfg.rollout.group_size:
        raise ConfigError(
            f"trainer.batch_size: must be a multiple of rollout.group_size ({cfg.rollout.group_size}), "
            f"got {cfg.trainer.batch_size}")
    if cfg.transport.capacity < cfg.rollout.group_size:
        raise ConfigError(f"transport.capacity: must hold at least one group ({cfg.rollout.group_size}), "
                          f"got {cfg.transport.capacity}")
    if cfg.engine.kv_cache_mb <= 0:
        raise ConfigError(f"engine.kv_cache_mb: must be > 0, got {cfg.engine.kv_cache_mb}")
    if not 0 <= cfg.engine.gpu_memory_fraction < 1:
        raise ConfigError(f"engine.gpu_memory_fraction: must be in [0, 1) (0 = auto), got {cfg.engine.gpu_memory_fraction}")
    if not 0 <= cfg.rollout.temperature <= 100:
        raise ConfigError(f"rollout.temperature: must be in [0, 100], got {cfg.rollout.temperature}")
    if not 0 < cfg.rollout.top_p <= 1:
        raise ConfigError(f"rollout.top_p: must be in (0, 1], got {cfg.rollout.top_p}")
    if not all(0 < t <= 1 for t in cfg.task.eval_targets):
        raise ConfigError(f"task.eval_targets: accuracies must lie in (0, 1], got {cfg.task.eval_targets}")
    if cfg.task.min_operand > cfg.task.max_operand:
        raise ConfigError("task.min_operand: must be <= task.max_operand")
    if cfg.transport.curve_keys_dir:
        _check_curve_keys(cfg.transport.curve_keys_dir)
