"""The trainer process: queue -> PPO step -> publish weights -> metrics, for `total_steps` steps.

    trainer_main(cfg)                                                    # local launch, `async-rl train`
    trainer_rank_main(cfg, rank, world_size, master_addr, master_port)   # a launcher that starts every rank

The trainer backend (`trainer.backend`) may run `trainer.world_size` ranks. Rank 0 owns
the queue, metrics, checkpoints and publishing; ranks 1..N-1 only train, following rank 0
in lock step (launch/trainer_ranks.py). `trainer_main` is rank 0 and starts ranks 1..N-1
as its own child processes; a launcher that places ranks itself (Ray) calls
`trainer_rank_main` once per rank with the same master address and port, where rank 0
will host the rendezvous store. A rank's device comes from async_rl.placement: in a trainer
process given a pool of GPUs (`trainer.device=cuda`) rank r takes the r-th (`local_rank`
overrides r); a rank given its own GPU (Ray: `cuda:0`) takes that one.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from async_rl.config import Config
from async_rl.models import model_config
from async_rl.trainer.backends import train_staleness
from async_rl.trainer.checkpoint import complete_checkpoints, prune_checkpoints
from async_rl.trainer.dynamic_sampling import fill_batch
from async_rl.trainer.trainer import split_by_age
from async_rl.utils.ledger import Ledger, committed_state
from async_rl.utils.prompts import PromptSet
from async_rl.transport.peers import group_frame_limit
from async_rl.transport.queue import QueueTimeout, TrajectoryQueueServer
from async_rl.utils.metrics import MetricsLogger
from async_rl.protocols import WeightPublisher
from async_rl.weight_sync.publishers import build_publisher
from async_rl.utils.cores import refresh_per_layer
from launch.best_checkpoint import BestKeeper
from launch.common import cap_gpu_memory, mark_up, setup_cores
from launch.consumption import CheckpointPolicy, Consumption
from launch.supervision import Drain, DrainRequested
from launch.trainer_ranks import follower_main, lead, local_followers, rank_threads

logger = logging.getLogger(__name__)


class PeerLostError(RuntimeError):
    """No rollout producer has been heard from for too long."""


def _wait_batch(queue: TrajectoryQueueServer, cfg: Config, on_tick=None, num: int = 0) -> list:
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


def _wait_producers_gone(queue: TrajectoryQueueServer, timeout: float) -> None:
    """After `stop`, give producers time to run their final evaluation and say goodbye. A producer
    that stopped heartbeating (a rollout side killed without a goodbye: the queue keeps it connected
    until transport.peer_timeout_s) is not waited for: a stop with a dead rollout side took the
    launcher's whole 20 s grace and a SIGKILL."""
    deadline = time.monotonic() + timeout
    silent_after = 3 * queue.heartbeat_s + 1.0
    while queue.producers_heard_within(silent_after) and time.monotonic() < deadline:
        time.sleep(0.2)


def publish_weights(publisher: WeightPublisher, queue: TrajectoryQueueServer, weights: Any,
                    version: int) -> dict[str, float]:
    """Publish one version through `weight_sync.transport` and tell the rollout side; return sync/ metrics.
    `weights`: `trainer.weights()`, read from the parameters bucket by bucket (no copy of the model).
    Raises (the old weights stay in use everywhere) when the transport fails or misses its deadline."""
    msg = publisher.publish(weights, version)
    if msg is not None:  # dist announces the version itself, before its collective
        queue.broadcast(msg)
    return dict(getattr(publisher, "stats", {}))


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
    run_dir = Path(cfg.run_dir)
    trainer = lead(cfg, world_size, master_addr, master_port, local_rank, check_followers)
    try:
        _lead_run(cfg, trainer, cores, run_dir)
    finally:
        trainer.close()


def _lead_run(cfg: Config, trainer, cores, run_dir: Path) -> None:
    if cores is not None:
        refresh_per_layer(trainer.model, cores)
    ledger = Ledger(run_dir / "ledger_trainer.jsonl")  # what became of every id, checked by `async-rl audit`
    # HELLOs wait until the state is loaded (open): a side that joined a resuming trainer before would be told
    # version 0, nothing consumed, and throw away a valid outbox, and generate committed prompts again
    try:
        queue = TrajectoryQueueServer(cfg.transport.addr, cfg.transport.capacity, heartbeat_s=cfg.transport.heartbeat_s,
                                      peer_timeout_s=cfg.transport.peer_timeout_s,
                                      curve_keys_dir=cfg.transport.curve_keys_dir, max_frame=max_frame(cfg), greet=False,
                                      insecure=cfg.transport.insecure)
    except BaseException:
        ledger.close()
        raise
    queue.journal = ledger.record  # sessions, groups received and refused
    metrics = MetricsLogger(run_dir / "metrics.jsonl", tensorboard=cfg.log.tensorboard)
    traj_log = MetricsLogger(run_dir / "trajectories.jsonl", tensorboard=False) if cfg.log.trajectories else None
    try:
        _serve(cfg, trainer, cores, run_dir, queue, ledger, metrics, traj_log)
    finally:
        metrics.close()
        if traj_log is not None:
            traj_log.close()
        queue.close()
        ledger.record("held_at_end", queue.unconsumed_ids())  # delivered, never consumed: the audit's "untrained"
        ledger.close()


def max_frame(cfg: Config) -> int:
    """The largest GROUP frame the trainer takes in: a group of rollout.group_size trajectories each as long as
    the model's context, with headroom (transport.peers.group_frame_limit)."""
    context = getattr(model_config(cfg.model), "max_position_embeddings", 0) or 32768
    return group_frame_limit(cfg.rollout.group_size, context)


def _serve(cfg: Config, trainer, cores, run_dir: Path, queue: TrajectoryQueueServer, ledger: Ledger,
           metrics: MetricsLogger, traj_log: MetricsLogger | None) -> None:
    logger.info("trainer queue listening on %s", queue.address)
    publisher = build_publisher(cfg, queue.broadcast)  # weight_sync.transport: disk | zmq | dist
    (run_dir / "trainer_address").write_text(queue.address)
    queue.run_id = _run_id(run_dir, cfg.trainer.resume)
    start, prompts = _resume(cfg, trainer, run_dir, queue, ledger) if cfg.trainer.resume else (0, PromptSet())
    book = Consumption(ledger, queue, prompts)
    policy = CheckpointPolicy(cfg.trainer.checkpoint_every, cfg.trainer.checkpoint_budget)
    queue.set_trainer_state(trainer.policy_version, trainer.policy_version * cfg.trainer.batch_size, book.prompts)
    queue.open()
    mark_up(run_dir, "trainer")
    # a thread lock, not tqdm's default multiprocessing one: a semaphore of a SIGKILLed trainer would be
    # reported leaked by the launcher's resource tracker at the end of a run that recovered from it
    tqdm.set_lock(threading.RLock())
    bar = tqdm(total=cfg.total_steps, initial=start, desc=f"train[{cfg.mode}]", disable=not cfg.log.progress,
               dynamic_ncols=True)
    versions = _Versions(queue, publisher, trainer)
    best = BestKeeper(cfg)  # run_dir/best: the version with the best held-out accuracy seen
    drain = Drain.install()  # SIGTERM: finish this step, checkpoint, tell the rollout side to stop
    skipped = 0
    tell_ready = cfg.mode == "async"  # what was ready at each ask: the rollout side paces on it (rollout.pace)
    try:
        step = start
        while step < cfg.total_steps and not drain.requested:
            t0 = time.perf_counter()
            if cores is not None:
                cores.idle()
            filtered: list[list] = []
            buffered = queue.stats().get("queue/depth", 0)  # what the rollout side had ready when asked
            try:
                groups = _next_batch(queue, cfg, book, step, filtered,
                                     on_tick=lambda: (versions.check(), drain.check()))
            except DrainRequested:
                break
            wait_s = time.perf_counter() - t0
            if cores is not None:
                cores.busy()
            if traj_log is not None:
                _log_trajectories(traj_log, groups, step)
            kept, stale, future = split_by_age([t for g in groups for t in g], trainer.policy_version,
                                               train_staleness(cfg), cfg.trainer.stale_tokens)
            t_train, thread_s = time.perf_counter(), cores.thread_seconds() if cores is not None else 0.0
            stats = trainer.train_step(groups)
            stats["timing/train_threads"] = _mean_threads(cores, thread_s, time.perf_counter() - t_train)
            if stats.get("train/skipped_batch"):
                skipped += 1
                book.consume(step, [], stale, future)
                _skip_batch(queue, len(stale) + len(future), trainer.policy_version, skipped)
                continue
            book.consume(step, kept, stale, future)  # room freed; producers told at the next checkpoint
            queue.set_trainer_state(trainer.policy_version, trainer.policy_version * cfg.trainer.batch_size,
                                    book.prompts)
            stats["train/skipped_batches"] = skipped
            stats.update(_filtered_stats(filtered))
            t1 = time.perf_counter()
            stats.update(versions.publish())
            kept_s = best.seconds
            best.after_publish(trainer)
            stats["timing/keep_best_s"] = best.seconds - kept_s
            if tell_ready:  # after the weights: a paced rollout side sets how far ahead it runs from this
                queue.broadcast({"kind": "pace", "buffered": buffered})
            stats.update(queue.stats())
            stats.update({"policy_version": trainer.policy_version, "timing/wait_s": wait_s,
                          "queue/buffered_at_ask": buffered,
                          "timing/publish_s": time.perf_counter() - t1, "timing/step_s": time.perf_counter() - t0})
            metrics.log(stats, step=step)
            bar.set_postfix(reward=f"{stats.get('train/reward_mean', float('nan')):.3f}",
                            v=trainer.policy_version, refresh=False)
            bar.update(1)
            if step + 1 < cfg.total_steps and policy.due(step + 1):
                _checkpoint(trainer, run_dir, step + 1, cfg, policy, book)
            step += 1
        _checkpoint(trainer, run_dir, step, cfg, policy, book)  # cfg.total_steps unless drained
        queue.broadcast({"kind": "stop", "final_version": trainer.policy_version})
        _wait_producers_gone(queue, timeout=cfg.rollout.connect_timeout_s + 120)
        if not drain.requested:  # the final evaluation has reported: its version competes too
            best.finish(trainer)
    finally:
        bar.close()


def _mean_threads(cores, thread_s: float, span_s: float) -> float:
    """Torch threads the step ran with, on average (cores lent while the engine waits change it)."""
    if cores is None or span_s <= 0:
        return float(torch.get_num_threads())
    return (cores.thread_seconds() - thread_s) / span_s


def _checkpoint(trainer, run_dir: Path, step: int, cfg: Config, policy: CheckpointPolicy,
                book: Consumption) -> None:
    """Save the checkpoint of `step`, commit what was consumed before it, prune older checkpoints."""
    t0 = time.monotonic()
    trainer.save_checkpoint(str(run_dir / "checkpoints" / f"step_{step:06d}"), step,
                            {"policy_version": trainer.policy_version, "run_id": _read_run_id(run_dir),
                             "trained_slots": trainer.policy_version * cfg.trainer.batch_size,
                             "rng": trainer.rng_state()})
    book.commit(step)
    prune_checkpoints(run_dir / "checkpoints", cfg.trainer.keep_checkpoints)
    policy.done(time.monotonic() - t0)


def _read_run_id(run_dir: Path) -> str:
    path = run_dir / "run_id"
    return path.read_text().strip() if path.is_file() else ""


def _run_checkpoint(run_dir: Path) -> Path | None:
    """The newest checkpoint of this run (one left in run_dir by an earlier run is not resumed from)."""
    run_id = _read_run_id(run_dir)
    for _, d in reversed(complete_checkpoints(run_dir / "checkpoints")):  # not one a killed trainer left half-written
        if json.loads((d / "meta.json").read_text()).get("run_id", run_id) == run_id:
            return d
    return None


def _run_id(run_dir: Path, resume: bool) -> str:
    """This run's identity (kept by a resumed run): producers' outboxes hold data of one run only."""
    path = run_dir / "run_id"
    if resume and path.is_file():
        return path.read_text().strip()
    run_id = uuid.uuid4().hex
    path.write_text(run_id)
    return run_id


def _resume(cfg: Config, trainer, run_dir: Path, queue: TrajectoryQueueServer,
            ledger: Ledger) -> tuple[int, PromptSet]:
    """Restore the newest checkpoint (weights, optimizer, version, RNG), or go back to step 0 with
    the initial weights when there is none; return the step to continue at and the prompt positions
    consumed before it. Everything after that step is undone: its metrics rows are dropped, the
    ledger marks the resume (the audit's final history leaves those steps out), and the ids consumed
    then are not marked seen, so the rollout side's re-sent copies are trained again."""
    ckpt = _run_checkpoint(run_dir)
    if ckpt is None:
        logger.warning("trainer.resume: no checkpoint under %s: starting again from step 0",
                       run_dir / "checkpoints")
        step = 0
    else:
        step = int(trainer.load_checkpoint(str(ckpt))["step"])
    path = run_dir / "metrics.jsonl"
    if path.is_file():
        keep = [line for line in path.read_text().splitlines() if line.strip() and json.loads(line)["step"] < step]
        path.write_text("".join(line + "\n" for line in keep))
    ids, prompts = committed_state(ledger.path, step)
    ledger.record("resumed", from_step=step)
    queue.mark_seen(ids)  # sent again by a producer: acknowledged, not trained twice
    logger.info("resumed from %s: step %d, policy version %d (%d trajectories consumed before it)",
                ckpt or "the initial weights", step, trainer.policy_version, len(ids))
    return step, PromptSet(above=prompts)


class _Versions:
    """Publishes each version, and replays the current one when a rollout side joins (or re-joins) a run
    in progress after it was published, so that side generates with the trainer's policy at once (its
    gate waits for them; see StalenessGate.join). A side connected when a version was published got it:
    no replay for it (with `dist` a replay is a collective every server takes part in, not a broadcast
    that a side holding the version may ignore)."""

    def __init__(self, queue: TrajectoryQueueServer, publisher: WeightPublisher, trainer) -> None:
        self.queue, self.publisher, self.trainer = queue, publisher, trainer
        self.sessions = 0  # sessions connected at the last publish (or seen by the last check)

    def publish(self) -> dict[str, float]:
        """Publish the trainer's current version; return its sync/ metrics."""
        sessions = self.queue.stats().get("queue/sessions", 0)  # before: one that connects meanwhile is replayed to
        stats = publish_weights(self.publisher, self.queue, self.trainer.weights(), self.trainer.policy_version)
        self.sessions = max(self.sessions, sessions)
        return stats

    def check(self) -> None:
        sessions = self.queue.stats().get("queue/sessions", 0)
        if sessions <= self.sessions:
            return
        if self.trainer.policy_version == 0:
            self.sessions = sessions
            return  # a side that joins at the start already holds version 0
        logger.info("a rollout side joined at version %d: publishing the current weights again",
                    self.trainer.policy_version)
        self.publish()


def _skip_batch(queue: TrajectoryQueueServer, n: int, version: int, skipped: int) -> None:
    """A batch the trainer dropped whole (consumed, committed with the next checkpoint): released
    from the rollout side's staleness accounting; not a train step."""
    queue.broadcast({"kind": "release", "n": n,
                     "reason": f"all {n} trajectories over-stale or newer than the weights at version {version}"})
    logger.warning("skipped batch %d: %d trajectories dropped, version stays %d", skipped, n, version)


def _next_batch(queue: TrajectoryQueueServer, cfg: Config, book: Consumption, step: int, filtered: list,
                on_tick) -> list:
    """The groups of step `step`. With trainer.dynamic_sampling, groups without reward variance are
    set aside (appended to `filtered`), consumed and released from the rollout side's staleness
    count, so its gate admits replacements, until a batch with signal is in hand."""
    def take(n: int) -> list:
        return _wait_batch(queue, cfg, on_tick=on_tick, num=n)

    if not cfg.trainer.dynamic_sampling:
        return take(cfg.trainer.batch_size)

    def set_aside(groups: list) -> None:
        trajs = [t for g in groups for t in g]
        book.filtered(step, trajs)
        queue.broadcast({"kind": "release", "n": len(trajs), "quiet": True,
                         "reason": f"{len(groups)} groups without reward variance filtered (dynamic sampling)"})
        filtered.extend(groups)

    return fill_batch(take, cfg.trainer.batch_size, set_aside)


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
