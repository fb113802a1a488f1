"""The rollout process: generation servers + rollout controller + greedy evaluation before and after."""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path

import torch

from async_rl.config import Config
from async_rl.engine.client import HttpGenerationClient
from async_rl.models import load_tokenizer
from async_rl.rollout.controller import RolloutController
from async_rl.rollout.evaluate import evaluate
from async_rl.tasks import build_task
from async_rl.transport.client import TrajectoryQueueClient
from async_rl.utils.metrics import MetricsLogger
from async_rl.weight_sync.receivers import build_receiver
from launch.procs import start_server, stop_all

logger = logging.getLogger(__name__)


def _record_eval(cfg: Config, when: str, version: int, stats: dict) -> None:
    row = {"when": when, "policy_version": version, **stats}
    with (Path(cfg.run_dir) / "eval.jsonl").open("a") as fh:
        fh.write(json.dumps(row) + "\n")
    logger.info("eval %s (v%d): accuracy %.3f on %d problems", when, version, stats["eval/accuracy"], stats["eval/n"])


async def _run(cfg: Config, addrs: list[str]) -> None:
    tokenizer = load_tokenizer(cfg.model)
    task = build_task(cfg.task)
    clients = [HttpGenerationClient(a) for a in addrs]
    queue = TrajectoryQueueClient(cfg.transport.addr, heartbeat_s=cfg.transport.heartbeat_s,
                                  peer_timeout_s=cfg.transport.peer_timeout_s)
    metrics = MetricsLogger(Path(cfg.run_dir) / "rollout_metrics.jsonl", tensorboard=False)
    try:
        await asyncio.gather(*(c.wait_ready(cfg.rollout.connect_timeout_s) for c in clients))
        await queue.connect(cfg.rollout.connect_timeout_s)
        eval_set = task.eval_samples()
        mc = cfg.rollout.max_concurrent
        _record_eval(cfg, "before", 0, await evaluate(clients, tokenizer, task, eval_set,
                                                      cfg.rollout.eval_max_new_tokens, mc))
        controller = RolloutController(cfg, pool, queue, queue.controls(), tokenizer, task, metrics,
                                       weights=weights)
        await controller.run(cfg.seed)
        if controller.final_version is not None:
            _record_eval(cfg, "after", controller.final_version,
                         await evaluate(clients, tokenizer, task, eval_set, cfg.rollout.eval_max_new_tokens, mc))
    finally:
        metrics.close()
        await queue.close()
        await asyncio.gather(*(c.close() for c in clients), return_exceptions=True)


def rollout_main(cfg: Config) -> None:
    torch.set_num_threads(1)  # this process only does I/O; the servers do the math
    Path(cfg.run_dir).mkdir(parents=True, exist_ok=True)
    (Path(cfg.run_dir) / "eval.jsonl").unlink(missing_ok=True)
    server = None
    addrs = list(cfg.rollout.server_addrs)
    if not addrs:
        server, url = start_server(cfg)
        addrs = [url]
    try:
        asyncio.run(_run(cfg, addrs))
    finally:
        if server is not None:
            stop_all([server])
    weights = build_receiver(cfg, queue)  # before connecting: zmq weight buckets are taken off the queue
