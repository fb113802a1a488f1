"""The rollout process: generation servers + rollout controller + greedy evaluation before and after.

It starts `rollout.num_servers` servers through `SERVER_LAUNCHERS[engine.backend]` (the
engine's CPU threads split between them; on GPUs each in the slot async_rl.placement gave
it, which its launcher passes as `servers`), or uses `rollout.server_addrs`. Every server
is checked to run the configured model, then they form one `ServerPool`: a server that
dies later is taken out of rotation and its requests move to the others; the run fails
only when none is left.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

import torch

from async_rl.agent import build_agent_context
from async_rl.config import Config, resolve_secret
from async_rl.engine.client import HttpGenerationClient
from async_rl.engine.clients import GENERATION_CLIENTS
from async_rl.models import load_tokenizer
from async_rl.placement import ROLLOUT, GpuSlot, for_process
from async_rl.rollout.controller import RolloutController
from async_rl.rollout.evaluate import Evaluation
from async_rl.rollout.periodic_eval import record_eval
from async_rl.rollout.failover import PooledGenerationClient
from async_rl.rollout.server_pool import ServerPool
from async_rl.tasks import build_task
from async_rl.transport.client import TrajectoryQueueClient
from async_rl.transport.outbox import Outbox, claim_side
from async_rl.utils.ledger import Ledger
from async_rl.utils.metrics import MetricsLogger
from async_rl.utils.prompts import prompt_of
from async_rl.weight_sync.receivers import build_receiver
from async_rl.launch.external_server import Starting
from async_rl.launch.common import effective_threads, mark_up, pin_to_pool, place_here
from async_rl.launch.procs import run_async, stop_all, with_overrides
from async_rl.launch.server_keeper import ServerKeeper, write_server_listing

logger = logging.getLogger(__name__)


def _record_eval(cfg: Config, when: str, version: int, stats: dict) -> None:
    record_eval(cfg.run_dir, {"when": when, "policy_version": version, **stats})
    logger.info("eval %s (v%d): accuracy %.3f on %d problems", when, version, stats["eval/accuracy"], stats["eval/n"])


def _clients(cfg: Config, addrs: list[str], external: bool) -> list[HttpGenerationClient]:
    api_key = resolve_secret(cfg.engine.api_key, "engine.api_key")  # the servers' bearer token ("" = none)
    client = GENERATION_CLIENTS[cfg.engine.backend]
    try:
        return [client(a, api_key=api_key, pause_mode=cfg.rollout.pause_mode,
                                     stream_interval=cfg.rollout.stream_interval) for a in addrs]
    except ValueError as exc:
        raise ValueError(f"rollout.server_addrs: {exc}" if external else str(exc)) from None


async def ready_pool(cfg: Config, addrs: list[str], external: bool, tokenizer: Any,
                      watch: Callable[[ServerPool], Any] | None = None) -> tuple[ServerPool, Any]:
    """The servers as a pool, once each answers and runs the configured model (one clear error otherwise).
    `watch(pool)` starts, before the first wait, what watches the servers meanwhile (the keeper: a server
    killed while this side waits for it is started again on its port, and the wait finds it); it is
    returned with the pool, and closed with it on an error."""
    pool = ServerPool(_clients(cfg, addrs, external), health_interval_s=cfg.rollout.health_interval_s)
    watcher = watch(pool) if watch else None
    try:
        for s in pool.servers:
            try:
                await s.client.wait_ready(cfg.rollout.connect_timeout_s)
            except ConnectionError as exc:
                raise ConnectionError(f"rollout.server_addrs[{s.index}]: {exc}" if external else str(exc)) from None
        await pool.check_model(model_name=cfg.model.name, min_vocab=len(tokenizer))
    except BaseException:
        if watcher is not None:
            await watcher.close()
        await pool.close()
        raise
    return pool, watcher


async def _run(cfg: Config, addrs: list[str], external: bool, procs: list[Any], producer_id: str,
               slots: list[GpuSlot]) -> None:
    tokenizer = load_tokenizer(cfg.model)
    task = build_task(cfg.task)
    queue = TrajectoryQueueClient(cfg.transport.addr, producer_id=producer_id,
                                  heartbeat_s=cfg.transport.heartbeat_s,
                                  peer_timeout_s=cfg.transport.peer_timeout_s,
                                  curve_keys_dir=cfg.transport.curve_keys_dir)
    weights = build_receiver(cfg, queue)  # before connecting: zmq weight buckets are taken off the queue
    try:
        if not external:
            # connected (and heartbeating) before our servers start: a real engine loads and compiles for minutes,
            # and the trainer, which waits rollout.connect_timeout_s for a first producer, hears this side meanwhile
            await queue.connect(cfg.rollout.connect_timeout_s)
            addrs = await _start_servers(cfg, slots, procs)
        # our own servers are restarted when their process dies, and caught up to the current weights
        keep = (lambda pool: ServerKeeper(cfg, procs, pool, weights, partial(restart_server, cfg, slots)).start()) \
            if procs else None
        pool, keeper = await ready_pool(cfg, addrs, external, tokenizer, keep)
        if external:  # servers already running: checked first, so a wrong address is the error a user sees
            await queue.connect(cfg.rollout.connect_timeout_s)
    except BaseException:
        await queue.close()
        raise
    weights = keeper.receiver if keeper else weights
    metrics = MetricsLogger(Path(cfg.run_dir) / "rollout_metrics.jsonl", tensorboard=cfg.log.tensorboard)
    ledger = Ledger(Path(cfg.run_dir) / "ledger_rollout.jsonl")  # trajectory ids produced (`async-rl audit`)
    ledger.record("side", producer=producer_id, identity=queue.identity)  # the audit matches it to the trainer's
    pool.start()
    try:
        joined_at = int(queue.trainer_state.get("policy_version", 0))
        evaluator = [PooledGenerationClient(pool, acquire_timeout_s=cfg.rollout.connect_timeout_s)]
        evaluation = Evaluation.for_run(cfg, evaluator, tokenizer, task, build_agent_context(cfg.agent))
        if joined_at == 0:  # a side that joins a run in progress has no "before" to measure
            (Path(cfg.run_dir) / "eval.jsonl").unlink(missing_ok=True)
            _record_eval(cfg, "before", 0, await evaluation.run(validation=False))  # v0 is no candidate
        outbox = Outbox(Path(cfg.run_dir) / "outbox", str(queue.trainer_state.get("run_id", "")))
        queue.on_acked = outbox.ack
        pending = resendable(outbox, ledger, joined_at)
        controller = RolloutController(cfg, pool, _DurableSink(queue, outbox), queue.controls(), tokenizer, task,
                                       metrics, weights=weights, ledger=ledger)
        queue.on_session = controller.trainer_rejoined
        # the trainer drops re-sent ids it already has; their prompts are not generated again
        controller.join(queue.trainer_state, resent=[q for g in pending if (q := prompt_of(g[0].info)) is not None])
        mark_up(cfg.run_dir, "rollout")
        if pending:
            logger.info("sending %d groups again that the trainer never acknowledged", len(pending))
            for group in pending:
                ledger.record("resent", [t.id for t in group])
                await queue.put_group(group)
        await controller.run(cfg.seed)
        if controller.final_version is not None:
            ledger.record("untrained_at_end", outbox.open_ids())  # produced, never consumed (sent or not): reported
            outbox.clear()
            _record_eval(cfg, "after", controller.final_version, await evaluation.run())
    finally:
        if keeper:
            await keeper.close()
        metrics.close()
        await queue.close()
        ledger.close()
        await pool.close()


async def _start_servers(cfg: Config, slots: list[GpuSlot], procs: list[Any]) -> list[str]:
    """`start_servers` off the event loop (heartbeats go on meanwhile); each process joins `procs` as it is
    spawned, and a cancelled start (SIGTERM) stops them all before this returns."""
    starting = Starting()
    try:
        started, urls = await asyncio.to_thread(start_servers, cfg, slots, starting)
    except BaseException:
        starting.abandon()
        procs.extend(p for p in starting.procs if p not in procs)  # in spawn order: only stopped from here
        raise
    procs.extend(started)  # server i's process at i, beside urls[i]: the keeper and the pool pair them by index
    return urls


def resendable(outbox: Outbox, ledger: Ledger, trainer_version: int) -> list[list]:
    """The groups this side produced before a restart that the trainer never committed, to send
    again. A group sampled (in part) by weights newer than the trainer's came from a future its
    resume threw away: discarded (ledgered; its prompt is generated again), never sent."""
    keep = []
    for group in outbox.pending():
        newest = max(t.newest_version() for t in group)
        if newest <= trainer_version:
            keep.append(group)
            continue
        ids = [t.id for t in group]
        ledger.record("discarded", ids, prompt=prompt_of(group[0].info),
                      reason=f"sampled at v{newest}, newer than the trainer's v{trainer_version} (it resumed)")
        outbox.ack(ids)
    return keep


class _DurableSink:
    """The queue, with every group kept in the outbox until the trainer acknowledges it."""

    def __init__(self, queue: TrajectoryQueueClient, outbox: Outbox):
        self.queue, self.outbox = queue, outbox

    async def put_group(self, trajectories: list) -> None:
        frames = self.queue.pack_group(trajectories)  # GroupRefused (too large for the trainer) before it is kept
        self.outbox.put(trajectories)
        await self.queue.put_group(trajectories, frames)


def server_config(cfg: Config, index: int, count: int, slot: GpuSlot) -> Config:
    """The config of server `index` of `count`: its share of the engine threads, its own port, and the
    device and memory share of its placement slot."""
    threads = max(1, effective_threads(cfg.engine.num_threads, cfg.mode) // count)
    port = cfg.engine.port + index if cfg.engine.port else 0
    return with_overrides(for_process(cfg, ROLLOUT, slot), engine={"num_threads": threads, "port": port})


def start_servers(cfg: Config, slots: list[GpuSlot], starting: Starting | None = None) -> tuple[list[Any], list[str]]:
    """Start `rollout.num_servers` servers of `engine.backend` at once, server i in `slots[i]`;
    (processes, urls) once all serve. `starting` tracks each process from its spawn; on any failure or
    interruption (Ctrl-C, SIGTERM) every one of them is stopped before this raises."""
    from async_rl.launch.servers import SERVER_LAUNCHERS

    n = cfg.rollout.num_servers
    launch = SERVER_LAUNCHERS[cfg.engine.backend]
    starting = starting or Starting()
    with ThreadPoolExecutor(max_workers=n) as pool:
        try:
            futures = [pool.submit(launch, server_config(cfg, i, n, slots[i]), i, slots[i].env(), starting)
                       for i in range(n)]
            results = [f.result() for f in futures]
        except BaseException:
            starting.abandon()  # the waits end at once; the executor's exit then does not wait them out
            raise
    logger.info("started %d generation server(s): %s", n, ", ".join(url for _, url in results))
    procs, urls = [proc for proc, _ in results], [url for _, url in results]
    write_server_listing(cfg.run_dir, procs, urls)
    return procs, urls


def restart_server(cfg: Config, slots: list[GpuSlot], index: int, port: int) -> tuple[Any, str]:
    """Start server `index` again on `port` (its old one, so its URL stays) in its slot; (process, url) once it serves."""
    from async_rl.launch.servers import SERVER_LAUNCHERS

    own = server_config(cfg, index, cfg.rollout.num_servers, slots[index])
    return SERVER_LAUNCHERS[cfg.engine.backend](with_overrides(own, engine={"port": port}), index, slots[index].env(),
                                                Starting())


def rollout_main(cfg: Config, servers: list[dict] | None = None) -> None:
    """The rollout side; `servers`: the placement slots (wire form) of the servers it starts, from its
    launcher; without them (the side started alone) it places its servers on this machine itself."""
    torch.set_num_threads(1)  # this process only does I/O; the servers do the math
    pin_to_pool(cfg, "rollout")  # the controller belongs to the rollout pool, beside its servers
    producer_id = claim_side(cfg.run_dir)  # before any server starts: one live side per run directory
    procs: list[Any] = []
    addrs = list(cfg.rollout.server_addrs)
    external = bool(addrs)
    if external and cfg.rollout.num_servers > 1:
        logger.warning("rollout.server_addrs is set: using its %d servers, not rollout.num_servers=%d",
                       len(addrs), cfg.rollout.num_servers)
    slots = ([GpuSlot.from_wire(s) for s in servers] if servers is not None
             else list(place_here(cfg, (ROLLOUT,)).servers))
    try:
        run_async(_run(cfg, addrs, external, procs, producer_id, slots))  # it starts our servers into `procs`
    finally:
        stop_all(procs)
