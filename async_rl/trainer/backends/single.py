"""The `single` trainer backend: today's `PPOTrainer` in one process (CPU or one GPU)."""

from __future__ import annotations

import dataclasses
from typing import Any

from async_rl.config import Config
from async_rl.models import load_model, load_tokenizer
from async_rl.trainer.backends import RankInfo, check_single, train_staleness, trainer_config
from async_rl.trainer.checkpoint import hf_exporter, load_checkpoint, save_checkpoint
from async_rl.trainer.trainer import PPOTrainer
from async_rl.utils.hardware import resolve_device


class SingleTrainer(PPOTrainer):
    """PPOTrainer with the backend interface's checkpoint and close."""

    def save_checkpoint(self, path: str, step: int, extra: dict[str, Any]) -> None:
        save_checkpoint(path, self.model, self.optimizer, step, extra, hf_export=self.hf_export)

    def load_checkpoint(self, path: str) -> dict[str, Any]:
        """Weights, optimizer state, version and RNG of a checkpoint this backend wrote; returns its meta."""
        meta = load_checkpoint(path, self.model, self.optimizer)
        self.policy_version = int(meta["policy_version"])
        if "rng" in meta:
            self.set_rng_state(meta["rng"])
        return meta

    def close(self) -> None:
        """Nothing to release: one process, no process group."""


def build(cfg: Config, rank: RankInfo) -> SingleTrainer:
    check_single(cfg)
    device = resolve_device(cfg.trainer.device, "trainer.device")
    # master weights stay fp32 whatever the engine runs in; trainer.compute_dtype picks autocast
    model = load_model(dataclasses.replace(cfg.model, dtype="float32"), seed=cfg.seed, device=device)
    trainer = SingleTrainer(model, trainer_config(cfg), temperature=cfg.rollout.temperature,
                            max_staleness=train_staleness(cfg), seed=cfg.seed)
    trainer.hf_export = hf_exporter(model.config, load_tokenizer(cfg.model))
    return trainer
