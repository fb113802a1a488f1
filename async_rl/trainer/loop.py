"""The trainer's step loop: queue -> PPO step -> publish weights -> metrics -> checkpoint, for `total_steps` steps.

`TrainerLoop` is the trainer side's counterpart of `RolloutController` (async_rl/rollout/controller.py):
it binds the trajectory queue at `transport.addr`, takes whole groups from it, trains them on a
trainer backend (async_rl/trainer/backends/), publishes every new version (replaying the current one
to a rollout side that joins late, async_rl/trainer/versions.py), books what it consumed so a crash
trains nothing twice (async_rl/trainer/consumption.py) and checkpoints on a time budget. The process
around it (cores, ranks, GPU share, SIGTERM) is async_rl/launch/trainer_proc.py.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch
from tqdm import tqdm

from async_rl.config import Config
from async_rl.models import model_config
from async_rl.trainer.backends import TrainerBackend, train_staleness
from async_rl.trainer.best_checkpoint import BestKeeper
from async_rl.trainer.checkpoint import prune_checkpoints
from async_rl.trainer.consumption import CheckpointPolicy, Consumption
from async_rl.trainer.drain import Drain, DrainRequested
from async_rl.trainer.dynamic_sampling import fill_batch
from async_rl.trainer.resume import read_run_id, resume, run_id
from async_rl.trainer.trainer import split_by_age
from async_rl.trainer.versions import VersionReplay
from async_rl.transport.peers import group_frame_limit
from async_rl.transport.queue import QueueTimeout, TrajectoryQueueServer
from async_rl.utils.cores import CoreShare, refresh_per_layer
from async_rl.utils.ledger import Ledger
from async_rl.utils.metrics import MetricsLogger
from async_rl.utils.prompts import PromptSet
from async_rl.weight_sync.publishers import build_publisher

logger = logging.getLogger(__name__)


class PeerLostError(RuntimeError):
    """No rollout producer has been heard from for too long."""


class TrainerLoop:
    """Trains `cfg.total_steps` steps on what a rollout side sends to `transport.addr`.

    Example: one trainer process on CPU, fed by `async-rl rollout` started with the same config:

        from async_rl.config import load_config
        from async_rl.trainer.backends import RankInfo, get_backend
        from async_rl.trainer.loop import TrainerLoop

        cfg = load_config("configs/debug_cpu.yaml", ["run_dir=/tmp/t", "transport.addr=tcp://127.0.0.1:5555"])
        trainer = get_backend(cfg.trainer.backend).build(cfg, RankInfo())
        try:
            TrainerLoop(cfg, trainer).run()     # returns after total_steps steps (or a drain)
        finally:
            trainer.close()

    `cores`: a CoreShare lent to the engine while the loop waits (async_rl/utils/cores.py).
    `loop.drain.request()` (from another thread) stops the loop after the current step, with a
    checkpoint; `handle_sigterm=True` makes SIGTERM do that once the loop serves (the trainer process:
    a SIGTERM before then ends the process as usual). `on_ready`: called once the queue is open and
    the trainer's state loaded.
    """

    def __init__(self, cfg: Config, trainer: TrainerBackend, *, cores: CoreShare | None = None,
                 handle_sigterm: bool = False, on_ready: Callable[[], None] | None = None) -> None:
        self.cfg, self.trainer, self.cores = cfg, trainer, cores
        self.run_dir = Path(cfg.run_dir)
        self.drain = Drain()
        self.handle_sigterm = handle_sigterm
        self.on_ready = on_ready
        self.skipped = 0  # batches dropped whole (every trajectory over-stale or too new)

    def run(self) -> None:
        """Train until `total_steps` (or a drain): open the queue, ledger and metrics, serve, close them."""
        cfg = self.cfg
        if self.cores is not None:
            refresh_per_layer(self.trainer.model, self.cores)
        self.ledger = Ledger(self.run_dir / "ledger_trainer.jsonl")  # what became of every id (`async-rl audit`)
        # HELLOs wait until the state is loaded (open): a side that joined a resuming trainer before would be told
        # version 0, nothing consumed, and throw away a valid outbox, and generate committed prompts again
        try:
            self.queue = TrajectoryQueueServer(
                cfg.transport.addr, cfg.transport.capacity, heartbeat_s=cfg.transport.heartbeat_s,
                peer_timeout_s=cfg.transport.peer_timeout_s, curve_keys_dir=cfg.transport.curve_keys_dir,
                max_frame=max_frame(cfg), greet=False, insecure=cfg.transport.insecure)
        except BaseException:
            self.ledger.close()
            raise
        self.queue.journal = self.ledger.record  # sessions, groups received and refused
        self.metrics = MetricsLogger(self.run_dir / "metrics.jsonl", tensorboard=cfg.log.tensorboard)
        self.traj_log = MetricsLogger(self.run_dir / "trajectories.jsonl", tensorboard=False) \
            if cfg.log.trajectories else None
        try:
            self._serve()
        finally:
            self.metrics.close()
            if self.traj_log is not None:
                self.traj_log.close()
            self.queue.close()
            self.ledger.record("held_at_end", self.queue.unconsumed_ids())  # delivered, never consumed: "untrained"
            self.ledger.close()

    def _open(self) -> int:
        """Load the run's state (a resume), open the queue to producers; return the step to start at."""
        cfg, trainer, queue = self.cfg, self.trainer, self.queue
        logger.info("trainer queue listening on %s", queue.address)
        publisher = build_publisher(cfg, queue.broadcast)  # weight_sync.transport: disk | zmq | dist
        (self.run_dir / "trainer_address").write_text(queue.address)
        queue.run_id = run_id(self.run_dir, cfg.trainer.resume)
        start, prompts = resume(cfg, trainer, self.run_dir, queue, self.ledger) if cfg.trainer.resume \
            else (0, PromptSet())
        self.book = Consumption(self.ledger, queue, prompts)
        self.policy = CheckpointPolicy(cfg.trainer.checkpoint_every, cfg.trainer.checkpoint_budget)
        queue.set_trainer_state(trainer.policy_version, trainer.policy_version * cfg.trainer.batch_size,
                                self.book.prompts)
        queue.open()
        if self.on_ready is not None:
            self.on_ready()
        self.versions = VersionReplay(queue, publisher, trainer)
        self.best = BestKeeper(cfg)  # run_dir/best: the version with the best held-out accuracy seen
        if self.handle_sigterm:  # SIGTERM: finish this step, checkpoint, tell the rollout side to stop
            self.drain.listen()
        return start

    def _serve(self) -> None:
        cfg, trainer = self.cfg, self.trainer
        start = self._open()
        # a thread lock, not tqdm's default multiprocessing one: a semaphore of a SIGKILLed trainer would be
        # reported leaked by the launcher's resource tracker at the end of a run that recovered from it
        tqdm.set_lock(threading.RLock())
        bar = tqdm(total=cfg.total_steps, initial=start, desc=f"train[{cfg.mode}]", disable=not cfg.log.progress,
                   dynamic_ncols=True)
        try:
            step = start
            while step < cfg.total_steps and not self.drain.requested:
                try:
                    stats = self._step(step)
                except DrainRequested:
                    break
                if stats is None:  # the whole batch was dropped: not a train step
                    continue
                bar.set_postfix(reward=f"{stats.get('train/reward_mean', float('nan')):.3f}",
                                v=trainer.policy_version, refresh=False)
                bar.update(1)
                if step + 1 < cfg.total_steps and self.policy.due(step + 1):
                    self._checkpoint(step + 1)
                step += 1
            self._checkpoint(step)  # cfg.total_steps unless drained
            self.queue.broadcast({"kind": "stop", "final_version": trainer.policy_version})
            _wait_producers_gone(self.queue, timeout=cfg.rollout.connect_timeout_s + 120)
            if not self.drain.requested:  # the final evaluation has reported: its version competes too
                self.best.finish(trainer)
        finally:
            bar.close()

    def _step(self, step: int) -> dict[str, float] | None:
        """Wait for a batch, train it, book it, publish the new version; its stats (None: dropped whole)."""
        cfg, trainer, queue, cores = self.cfg, self.trainer, self.queue, self.cores
        t0 = time.perf_counter()
        if cores is not None:
            cores.idle()
        filtered: list[list] = []
        buffered = queue.stats().get("queue/depth", 0)  # what the rollout side had ready when asked
        groups = next_batch(queue, cfg, self.book, step, filtered,
                            on_tick=lambda: (self.versions.check(), self.drain.check()))
        wait_s = time.perf_counter() - t0
        if cores is not None:
            cores.busy()
        if self.traj_log is not None:
            _log_trajectories(self.traj_log, groups, step)
        kept, stale, future = split_by_age([t for g in groups for t in g], trainer.policy_version,
                                           train_staleness(cfg), cfg.trainer.stale_tokens)
        t_train, thread_s = time.perf_counter(), cores.thread_seconds() if cores is not None else 0.0
        stats = trainer.train_step(groups)
        stats["timing/train_threads"] = _mean_threads(cores, thread_s, time.perf_counter() - t_train)
        if stats.get("train/skipped_batch"):
            self.skipped += 1
            self.book.consume(step, [], stale, future)
            _skip_batch(queue, len(stale) + len(future), trainer.policy_version, self.skipped)
            return None
        self.book.consume(step, kept, stale, future)  # room freed; producers told at the next checkpoint
        queue.set_trainer_state(trainer.policy_version, trainer.policy_version * cfg.trainer.batch_size,
                                self.book.prompts)
        stats["train/skipped_batches"] = self.skipped
        stats.update(_filtered_stats(filtered))
        t1 = time.perf_counter()
        stats.update(self.versions.publish())
        kept_s = self.best.seconds
        self.best.after_publish(trainer)
        stats["timing/keep_best_s"] = self.best.seconds - kept_s
        if cfg.mode == "async":  # after the weights: a paced rollout side sets how far ahead it runs from this
            queue.broadcast({"kind": "pace", "buffered": buffered})
        stats.update(queue.stats())
        stats.update({"policy_version": trainer.policy_version, "timing/wait_s": wait_s,
                      "queue/buffered_at_ask": buffered,
                      "timing/publish_s": time.perf_counter() - t1, "timing/step_s": time.perf_counter() - t0})
        self.metrics.log(stats, step=step)
        return stats

    def _checkpoint(self, step: int) -> None:
        """Save the checkpoint of `step`, commit what was consumed before it, prune older checkpoints."""
        cfg, trainer = self.cfg, self.trainer
        t0 = time.monotonic()
        trainer.save_checkpoint(str(self.run_dir / "checkpoints" / f"step_{step:06d}"), step,
                                {"policy_version": trainer.policy_version, "run_id": read_run_id(self.run_dir),
                                 "trained_slots": trainer.policy_version * cfg.trainer.batch_size,
                                 "rng": trainer.rng_state()})
        self.book.commit(step)
        prune_checkpoints(self.run_dir / "checkpoints", cfg.trainer.keep_checkpoints)
        self.policy.done(time.monotonic() - t0)


def max_frame(cfg: Config) -> int:
    """The largest GROUP frame the trainer takes in: a group of rollout.group_size trajectories each as long as
    the model's context, with headroom (transport.peers.group_frame_limit)."""
    context = getattr(model_config(cfg.model), "max_position_embeddings", 0) or 32768
    return group_frame_limit(cfg.rollout.group_size, context)


def wait_batch(queue: TrajectoryQueueServer, cfg: Config, on_tick=None, num: int = 0) -> list:
    """Block until `num` trajectories (whole groups; default a train batch) are buffered; fail
    clearly if the rollout side is lost.

    The queue drops a producer silent for transport.peer_timeout_s (checked every heartbeat_s);
    when that leaves none, the rollout side is reported lost at once, so a killed rollout side
    is reported within peer_timeout_s + 2 * heartbeat_s. With no producer connected at all, it
    is reported after peer_timeout_s (said goodbye), or rollout.connect_timeout_s if none ever
    sent anything (the rollout side may still be starting its servers). A rollout side that was
    lost may come back within transport.rejoin_timeout_s (0 = report it lost at once); `on_tick`
    runs between waits (the caller replays the current weights to a side that joined)."""
    silent_since: float | None = None
    timeout = cfg.transport.peer_timeout_s
    while True:
        if on_tick is not None:
            on_tick()
        try:
            # acknowledged only once trained and published: a trainer crash mid-step loses nothing
            return queue.get_groups(num or cfg.trainer.batch_size, timeout=cfg.transport.heartbeat_s, ack=False)
        except QueueTimeout:
            stats = queue.stats()
            if stats.get("queue/producers", 0):
                silent_since = None
                continue
            if stats.get("queue/lost_producers", 0) and cfg.transport.rejoin_timeout_s <= 0:
                raise PeerLostError(
                    f"lost the rollout side: no message from it at {queue.address} for more than {timeout:g}s "
                    "(transport.peer_timeout_s); did `async-rl rollout` crash?") from None
            silent_since = silent_since or time.monotonic()
            if stats.get("queue/lost_producers", 0):
                wait, key = cfg.transport.rejoin_timeout_s, "transport.rejoin_timeout_s"
            elif stats.get("queue/received", 0):
                wait, key = timeout, "transport.peer_timeout_s"
            else:
                wait, key = max(timeout, cfg.rollout.connect_timeout_s), "rollout.connect_timeout_s"
            if time.monotonic() - silent_since > wait:
                raise PeerLostError(
                    f"no rollout producer connected to {queue.address} for {wait:.0f}s "
                    f"({key}; is `async-rl rollout` running and pointed at this address?)") from None


def next_batch(queue: TrajectoryQueueServer, cfg: Config, book: Consumption, step: int, filtered: list,
               on_tick) -> list:
    """The groups of step `step`. With trainer.dynamic_sampling, groups without reward variance are
    set aside (appended to `filtered`), consumed and released from the rollout side's staleness
    count, so its gate admits replacements, until a batch with signal is in hand."""
    def take(n: int) -> list:
        return wait_batch(queue, cfg, on_tick=on_tick, num=n)

    if not cfg.trainer.dynamic_sampling:
        return take(cfg.trainer.batch_size)

    def set_aside(groups: list) -> None:
        trajs = [t for g in groups for t in g]
        book.filtered(step, trajs)
        queue.broadcast({"kind": "release", "n": len(trajs), "quiet": True,
                         "reason": f"{len(groups)} groups without reward variance filtered (dynamic sampling)"})
        filtered.extend(groups)

    return fill_batch(take, cfg.trainer.batch_size, set_aside)


def _wait_producers_gone(queue: TrajectoryQueueServer, timeout: float) -> None:
    """After `stop`, give producers time to run their final evaluation and say goodbye. A producer
    that stopped heartbeating (a rollout side killed without a goodbye: the queue keeps it connected
    until transport.peer_timeout_s) is not waited for: a stop with a dead rollout side took the
    launcher's whole 20 s grace and a SIGKILL."""
    deadline = time.monotonic() + timeout
    silent_after = 3 * queue.heartbeat_s + 1.0
    while queue.producers_heard_within(silent_after) and time.monotonic() < deadline:
        time.sleep(0.2)


def _mean_threads(cores: CoreShare | None, thread_s: float, span_s: float) -> float:
    """Torch threads the step ran with, on average (cores lent while the engine waits change it)."""
    if cores is None or span_s <= 0:
        return float(torch.get_num_threads())
    return (cores.thread_seconds() - thread_s) / span_s


def _skip_batch(queue: TrajectoryQueueServer, n: int, version: int, skipped: int) -> None:
    """A batch the trainer dropped whole (consumed, committed with the next checkpoint): released
    from the rollout side's staleness accounting; not a train step."""
    queue.broadcast({"kind": "release", "n": n,
                     "reason": f"all {n} trajectories over-stale or newer than the weights at version {version}"})
    logger.warning("skipped batch %d: %d trajectories dropped, version stays %d", skipped, n, version)


def _filtered_stats(filtered: list) -> dict[str, float]:
    """What dynamic sampling set aside while this step's batch was filled."""
    rewards = [t.reward for g in filtered for t in g]
    return {"train/filtered_groups": float(len(filtered)),
            "train/filtered_reward_mean": float(sum(rewards) / len(rewards)) if rewards else 0.0}


def _log_trajectories(log: MetricsLogger, groups: list, step: int) -> None:
    """Every trajectory of a train batch as one JSONL row (`log.trajectories`): audits, reproducibility."""
    for group in groups:
        for t in group:
            log.log({"id": t.id, "group_id": t.group_id, "sample_id": t.info.get("sample_id"), "reward": t.reward,
                     "prompt_ids": t.prompt_ids.tolist(), "response_ids": t.response_ids.tolist(),
                     "loss_mask": t.loss_mask.tolist(), "behav_logprobs": t.behav_logprobs.tolist(),
                     "versions": t.versions.tolist(), "finish_reason": t.finish_reason}, step=step)
