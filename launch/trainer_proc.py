"""The trainer process: queue -> PPO step -> publish weights -> metrics, for `total_steps` steps."""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path

import torch
from tqdm import tqdm

from async_rl.config import Config
from async_rl.models import load_model
from async_rl.trainer.checkpoint import save_checkpoint
from async_rl.trainer.trainer import PPOTrainer
from async_rl.transport.queue import QueueTimeout, TrajectoryQueueServer
from async_rl.utils.metrics import MetricsLogger
from async_rl.protocols import WeightPublisher
from async_rl.weight_sync.publishers import build_publisher
from async_rl.utils.hardware import resolve_device
from launch.common import effective_threads

logger = logging.getLogger(__name__)


class PeerLostError(RuntimeError):
    """No rollout producer has been heard from for too long."""


def _wait_batch(queue: TrajectoryQueueServer, cfg: Config) -> list:
    """Block until a train batch is buffered; fail clearly if the rollout side is lost.

    The queue drops a producer silent for transport.peer_timeout_s (checked every heartbeat_s);
    when that leaves none, the rollout side is reported lost at once, so a killed rollout side
    is reported within peer_timeout_s + 2 * heartbeat_s. With no producer connected at all
    (never started, or said goodbye), it is reported after peer_timeout_s."""
    silent_since: float | None = None
    timeout = cfg.transport.peer_timeout_s
    while True:
        try:
            # acknowledged only once trained and published: a trainer crash mid-step loses nothing
            return queue.get_groups(cfg.trainer.batch_size, timeout=cfg.transport.heartbeat_s, ack=False)
        except QueueTimeout:
            stats = queue.stats()
            if stats.get("queue/producers", 0):
                silent_since = None
                continue
            if stats.get("queue/lost_producers", 0):
                raise PeerLostError(
                    f"lost the rollout side: no message from it at {queue.address} for more than {timeout:g}s "
                    "(transport.peer_timeout_s); did `async-rl rollout` crash?") from None
            silent_since = silent_since or time.monotonic()
            if time.monotonic() - silent_since > timeout:
                raise PeerLostError(
                    f"no rollout producer connected to {queue.address} for {timeout:.0f}s "
                    "(transport.peer_timeout_s; is `async-rl rollout` running and pointed at this address?)") from None


def _wait_producers_gone(queue: TrajectoryQueueServer, timeout: float) -> None:
    """After `stop`, give producers time to run their final evaluation and say goodbye."""
    deadline = time.monotonic() + timeout
    while queue.stats().get("queue/producers", 0) and time.monotonic() < deadline:
        time.sleep(0.2)


def publish_weights(publisher: WeightPublisher, queue: TrajectoryQueueServer, state_dict: dict,
                    version: int) -> dict[str, float]:
    """Publish one version through `weight_sync.transport` and tell the rollout side; return sync/ metrics.
    Raises (the old weights stay in use everywhere) when the transport fails or misses its deadline."""
    msg = publisher.publish(state_dict, version)
    if msg is not None:  # dist announces the version itself, before its collective
        queue.broadcast(msg)
    return dict(getattr(publisher, "stats", {}))


def trainer_main(cfg: Config) -> None:
    torch.set_num_threads(effective_threads(cfg.trainer.num_threads, cfg.mode))
    torch.manual_seed(cfg.seed)
    run_dir = Path(cfg.run_dir)
    # master weights stay fp32 whatever the engine runs in; trainer.compute_dtype picks autocast
    device = resolve_device(cfg.trainer.device, "trainer.device")
    model = load_model(dataclasses.replace(cfg.model, dtype="float32"), seed=cfg.seed, device=device)
    eta = 0 if cfg.mode == "sync" else cfg.max_staleness
    trainer = PPOTrainer(model, cfg.trainer, temperature=cfg.rollout.temperature, max_staleness=eta, seed=cfg.seed)
    metrics = MetricsLogger(run_dir / "metrics.jsonl", tensorboard=cfg.log.tensorboard)
    queue = TrajectoryQueueServer(cfg.transport.addr, cfg.transport.capacity,
                                  heartbeat_s=cfg.transport.heartbeat_s, peer_timeout_s=cfg.transport.peer_timeout_s)
    logger.info("trainer queue listening on %s", queue.address)
    publisher = build_publisher(cfg, queue.broadcast)  # weight_sync.transport: disk | zmq | dist
    (run_dir / "trainer_address").write_text(queue.address)
    bar = tqdm(total=cfg.total_steps, desc=f"train[{cfg.mode}]", disable=not cfg.log.progress, dynamic_ncols=True)
    try:
        for step in range(cfg.total_steps):
            t0 = time.perf_counter()
            groups = _wait_batch(queue, cfg)
            wait_s = time.perf_counter() - t0
            stats = trainer.train_step(groups)
            t1 = time.perf_counter()
            stats.update(publish_weights(publisher, queue, trainer.state_dict(), trainer.policy_version))
            queue.ack([t.id for g in groups for t in g])
            stats.update(queue.stats())
            stats.update({"policy_version": trainer.policy_version, "timing/wait_s": wait_s,
                          "timing/publish_s": time.perf_counter() - t1, "timing/step_s": time.perf_counter() - t0})
            metrics.log(stats, step=step)
            bar.set_postfix(reward=f"{stats.get('train/reward_mean', float('nan')):.3f}",
                            v=trainer.policy_version, refresh=False)
            bar.update(1)
            every = cfg.trainer.checkpoint_every
            if every and (step + 1) % every == 0 and step + 1 < cfg.total_steps:
                save_checkpoint(str(run_dir / "checkpoints" / f"step_{step + 1:06d}"), model, trainer.optimizer,
                                step + 1, {"policy_version": trainer.policy_version})
        save_checkpoint(str(run_dir / "checkpoints" / f"step_{cfg.total_steps:06d}"), model, trainer.optimizer,
                        cfg.total_steps, {"policy_version": trainer.policy_version})
        queue.broadcast({"kind": "stop", "final_version": trainer.policy_version})
        _wait_producers_gone(queue, timeout=cfg.rollout.connect_timeout_s + 120)
    finally:
        bar.close()
        metrics.close()
        queue.close()
