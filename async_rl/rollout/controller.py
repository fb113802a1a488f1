"""The rollout controller: dataset -> agent loops -> trajectory queue, under the staleness gate.

It drives the generation servers of its side through a `ServerPool`. For each prompt it
admits one group of `n` trajectories through the staleness gate, runs `n` agent loops
concurrently, each on a `PooledGenerationClient` (least-loaded server; a request whose
server is lost moves to another one), and pushes the finished group to the trainer.
Control messages from the trainer drive weight updates (every server paused, loaded and
continued under `weight_sync.deadline_s`, a late one fenced; then the gate opens one
version further) and the end of the run.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

from async_rl.agent import as_trajectory, build_agent_context, build_agent_loop, check_agent_names
from async_rl.agent.trace import TraceWriter
from async_rl.config import Config
from async_rl.protocols import GenerationClient, TrajectorySink, WeightReceiver
from async_rl.rewards.shaping import truncated_reward
from async_rl.rollout.evaluate import Evaluation
from async_rl.rollout.failover import PooledGenerationClient
from async_rl.rollout.periodic_eval import PeriodicEval
from async_rl.rollout.server_pool import ServerPool
from async_rl.rollout.staleness import StalenessGate
from async_rl.rollout.weight_update import update_servers
from async_rl.types import GroupRefused, RequestRefused, Sample, SamplingParams, new_id, nonfinite_score
from async_rl.utils.ledger import Ledger
from async_rl.utils.metrics import MetricsLogger
from async_rl.utils.prompts import PROMPT_KEY, PromptSet
from async_rl.utils.seeding import derive_seed
from async_rl.weight_sync.receivers import DiskWeightReceiver
from async_rl.weight_sync.staging import WeightsSuperseded

logger = logging.getLogger(__name__)


class TrainerRolledBack(RuntimeError):
    """The trainer resumed behind this rollout side's version: the side must start again."""


class RolloutController:
    def __init__(self, cfg: Config, clients: list[GenerationClient] | ServerPool, sink: TrajectorySink,
                 controls: AsyncIterator[dict[str, Any]], tokenizer: Any, task: Any,
                 metrics: MetricsLogger | None = None, weights: WeightReceiver | None = None,
                 ledger: Ledger | None = None):
        self.cfg = cfg
        self._own_pool = not isinstance(clients, ServerPool)  # a pool handed in is started and closed by its owner
        self.pool = ServerPool(clients, health_interval_s=cfg.rollout.health_interval_s) \
            if self._own_pool else clients
        self.sink = sink
        self.controls = controls
        self.tokenizer = tokenizer
        self.task = task
        self.metrics = metrics
        self.ledger = ledger  # trajectory ids produced / abandoned (async_rl/utils/ledger.py)
        self.weights = weights or DiskWeightReceiver()  # turns a "weights" control message into loaded servers
        self.gate = StalenessGate.for_config(cfg)
        self.slots = asyncio.Semaphore(cfg.rollout.max_concurrent)
        self.params = SamplingParams(
            max_new_tokens=cfg.rollout.max_new_tokens, temperature=cfg.rollout.temperature,
            top_p=cfg.rollout.top_p, top_k=cfg.rollout.top_k)
        self.final_version: int | None = None
        self.groups_pushed = 0
        self.trajectories_pushed = 0
        self.interrupted = 0
        self.restarted_stale = 0
        self.released = 0  # trajectories the trainer consumed without a version (dropped whole, filtered)
        self.refused = 0  # trajectories of groups this side refused to send (a non-finite score, too large a frame)
        self.superseded = 0  # weight versions skipped: pruned behind newer ones before any server loaded them
        self._attempts: dict[asyncio.Task, int] = {}  # generations in flight -> the version each started under
        self._running: dict[int, asyncio.Task] = {}  # prompt position -> its group, until generated
        self._generating = 0  # trajectories admitted and not finished (the gate's fill ramp reads it)
        self._joined_version = 0
        self._stop = asyncio.Event()
        self._error: BaseException | None = None
        self._tasks: set[asyncio.Task] = set()
        self._t0 = time.perf_counter()
        self._seed = cfg.seed
        self._cpu0 = time.process_time()  # reset when generation begins (run)
        self._update_cpu = 0.0  # of it, spent in weight updates
        self._skip = PromptSet()  # stream positions not to generate: the trainer holds them, or they are re-sent
        self.tracer = TraceWriter(Path(cfg.run_dir) / "traces.jsonl", cfg.rollout.trace_every) \
            if cfg.rollout.trace_every > 0 else None
        self.agent_context = build_agent_context(cfg.agent, trace=self.tracer)
        check_agent_names(self.agent_context, cfg.rollout.agent, task.names_used())
        self.periodic_eval: PeriodicEval | None = None
        if cfg.rollout.eval_every > 0:
            untraced = dataclasses.replace(self.agent_context, trace=None)  # traces show training episodes
            self.periodic_eval = PeriodicEval(cfg.rollout.eval_every, cfg.run_dir, Evaluation.for_run(
                cfg, [PooledGenerationClient(self.pool, sticky=False)], tokenizer, task, untraced))

    # ------------------------------------------------------------------ one group
    async def _one(self, sample: Sample, group_id: str, index: int):
        # the sampling seed depends only on the run seed, the sample and its place in the group, so a
        # run is reproducible and eta=0 async samples exactly what sync does
        params = dataclasses.replace(self.params, seed=derive_seed(self._seed, sample.id, index))
        try:
            async with self.slots:
                return await self._attempts_until_done(sample, params, group_id)
        finally:
            self._generating -= 1  # admitted, generating or waiting for a slot, until here
            self.gate.notify()  # the fill ramp may admit more now

    async def _attempts_until_done(self, sample: Sample, params: SamplingParams, group_id: str):
        while True:  # one attempt, or more when an attempt went too stale to be trained (see _restart_stale)
            attempt = asyncio.create_task(self._attempt(sample, params, group_id))
            self._attempts[attempt] = self.gate.version
            try:
                await asyncio.wait({attempt})
            except asyncio.CancelledError:  # the group itself is cancelled (end of run)
                attempt.cancel()
                raise
            finally:
                self._attempts.pop(attempt, None)
            if not attempt.cancelled():
                return attempt.result()

    async def _attempt(self, sample: Sample, params: SamplingParams, group_id: str):
        client = PooledGenerationClient(self.pool, sticky=True, acquire_timeout_s=self.cfg.rollout.connect_timeout_s,
                                        overload_margin=self.cfg.rollout.sticky_overload_margin)
        agent = build_agent_loop(sample.agent or self.cfg.rollout.agent, client, self.tokenizer,
                                 self.task.reward, self.agent_context)
        traj = as_trajectory(await agent.run(sample, params, group_id=group_id), group_id, sample)
        return truncated_reward(traj, self.cfg.rollout.truncated_reward)

    def _restart_stale(self, version: int) -> None:
        """Weights `version` are loaded: a generation that started more than max_staleness versions
        earlier cannot be trained any more (the trainer is at `version` or later and drops it), so it
        is aborted and its sample starts again under `version` (the slot and the gate's count stay)."""
        if not self.cfg.rollout.restart_stale:
            return
        for attempt in self.gate.stale_attempts(self._attempts, version):
            if not attempt.done():
                attempt.cancel()
                self.restarted_stale += 1

    async def _group(self, position: int, sample: Sample) -> None:
        group_id = new_id()
        t0 = time.perf_counter()
        self._running[position] = asyncio.current_task()
        try:
            trajs, refused = await self._samples_of(sample, group_id)
        finally:
            self._running.pop(position, None)
        for t in trajs:
            t.timings["group_s"] = time.perf_counter() - t0
            t.info[PROMPT_KEY] = position  # the trainer's and the audit's account of the prompt stream
        if self.ledger is not None:  # before sending: a group lost on the way shows up in the audit
            self.ledger.record("produced", [t.id for t in trajs], prompt=position)
        try:
            if refused is not None:  # one request of the group was refused: the group cannot be trained
                raise GroupRefused("a generation server refused a request of the group",
                                   f"sample {sample.id} (prompt {position}): {refused}")
            self._check_scores(sample, position, trajs)
            await self.sink.put_group(list(trajs))
        except GroupRefused as exc:
            self._refuse(position, trajs, exc)
            return
        self.groups_pushed += 1
        self.trajectories_pushed += len(trajs)
        self.interrupted += sum(1 for t in trajs if t.num_interruptions > 0)

    async def _samples_of(self, sample: Sample, group_id: str) -> tuple[list, RequestRefused | None]:
        """The group's samples, generated at once; a request a server refuses (`RequestRefused`: a prompt too long
        for its context, parameters it will not take) ends the group: the others are cancelled and what finished
        comes back with the refusal. Any other failure is raised."""
        tasks = [asyncio.ensure_future(self._one(sample, group_id, k)) for k in range(self.cfg.rollout.group_size)]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        finally:
            failed = [t for t in tasks if t.done() and not t.cancelled() and t.exception() is not None]
            if failed or not all(t.done() for t in tasks):  # a failure, or this group is cancelled
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
        refusal = next((t.exception() for t in failed if isinstance(t.exception(), RequestRefused)), None)
        if failed and refusal is None:
            raise failed[0].exception()
        return [t.result() for t in tasks if not t.cancelled() and t.exception() is None], refusal

    def _check_scores(self, sample: Sample, position: int, trajs: list) -> None:
        """A trajectory whose reward (or a turn score) is not a finite number cannot be trained: GroupRefused
        naming the reward function and the sample (its whole group goes: a group's advantages need every score)."""
        bad = [(k, why) for k, t in enumerate(trajs) if (why := nonfinite_score(t.reward, t.info))]
        if not bad:
            return
        fn = getattr(self.task.reward, "__qualname__", repr(self.task.reward))
        raise GroupRefused(f"a non-finite score from agent loop {sample.agent or self.cfg.rollout.agent!r} "
                           f"(reward function {fn})",
                           f"sample {sample.id} (prompt {position}), answer {bad[0][0] + 1} of {len(trajs)}: "
                           f"{bad[0][1]} ({len(bad)} of the group's answers so)")

    def _refuse(self, position: int, trajs: list, refusal: GroupRefused) -> None:
        """A group that cannot be trained: not sent, ledgered as refused, its room in the staleness count given back."""
        logger.warning("refused a group, not sent to the trainer: %s%s", refusal,
                       f"; {refusal.detail}" if refusal.detail else "")
        if self.ledger is not None:
            self.ledger.record("refused", [t.id for t in trajs], prompt=position, reason=str(refusal),
                               detail=refusal.detail)
        self.refused += len(trajs)
        self.gate.release(self.cfg.rollout.group_size)  # the whole group's room, however many of it finished

    def _spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.error("rollout task failed: %r", task.exception())
            self._error = task.exception()
            self._stop.set()

    # ------------------------------------------------------------------ loops
    async def _admit_loop(self, samples: Iterator[tuple[int, Sample]]) -> None:
        n = self.cfg.rollout.group_size
        while not self._stop.is_set():
            await self.gate.wait_admit(n, lambda: self._generating)
            if self._stop.is_set():
                return
            self._generating += n
            self._spawn(self._group(*next(samples)))

    def _samples(self, seed: int) -> Iterator[tuple[int, Sample]]:
        """(position, sample) of the task's stream, leaving out the positions in `_skip`."""
        return ((i, s) for i, s in enumerate(self.task.train_samples(seed)) if i not in self._skip)

    def join(self, trainer_state: dict[str, Any], resent: list[int] = ()) -> None:
        """Start from the trainer's accounting (WELCOME's state): the staleness bound's count, and
        the prompt positions it holds; with the positions of the groups this side sends again (counted
        by the gate unless the trainer holds them), those are not generated, every other one is (a dead
        side's unfinished prompts included). When
        joining a run in progress, no prompt is admitted before the trainer's weights are loaded here."""
        version, admitted = int(trainer_state.get("policy_version", 0)), int(trainer_state.get("admitted", 0))
        self._joined_version = version
        held = trainer_state.get("prompts")
        self._skip = held.copy() if isinstance(held, PromptSet) else PromptSet()
        # re-sent groups the trainer does not hold yet count against the bound like new ones: uncounted,
        # they would keep one batch more in the pipeline for the rest of the run (every batch staler)
        admitted += self.cfg.rollout.group_size * len({q for q in resent if q not in self._skip})
        self._skip.update(resent)
        if version == 0 and admitted == 0:
            return
        self.gate.join(admitted)
        logger.info("joining a run in progress at version %d (%d trajectories already counted, prompts from "
                    "position %d on): generating once its weights are loaded", version, admitted, self._skip.low)

    def trainer_rejoined(self, trainer_state: dict[str, Any]) -> None:
        """A later WELCOME (the trainer restarted, or timed this side out). A trainer that went back
        to an earlier version (it resumed from a checkpoint) threw away the weights this side samples
        with, and its version numbers will name other weights: this side must start again."""
        version = int(trainer_state.get("policy_version", 0))
        if version < max(self.gate.version, self._joined_version):
            self._error = TrainerRolledBack(
                f"the trainer resumed at version {version}, behind this side's v{self.gate.version}: it went back to a "
                "checkpoint, so this side's weights and in-flight work belong to a discarded future; restart the "
                "rollout side (`async-rl run` does so itself) and it continues from the trainer's state")
            self._stop.set()

    async def apply_weights(self, msg: dict[str, Any]) -> None:
        version = int(msg["version"])
        if version <= self.pool.version:  # a replay for a side that just joined: we have these weights
            try:
                await self.weights.release(await self.weights.prepare(msg))
            except WeightsSuperseded:
                pass  # and pruned since: nothing to release
            logger.debug("weights v%d already loaded: replay ignored", version)
            return
        cpu0 = time.process_time()
        try:
            stats = await update_servers(self.pool, self.weights, msg, self.cfg.weight_sync.deadline_s)
        except WeightsSuperseded as exc:  # the trainer ran ahead; its newer version's message follows
            self.superseded += 1
            logger.warning("%s", exc)
            return
        finally:
            self._update_cpu += time.process_time() - cpu0
        self.gate.set_version(version)
        self._restart_stale(version)
        if self.periodic_eval is not None:
            self.periodic_eval.maybe_start(version)
        stats.update({"rollout/groups_pushed": self.groups_pushed, "rollout/trajectories_pushed": self.trajectories_pushed,
                      "rollout/interrupted": self.interrupted, "rollout/restarted_stale": self.restarted_stale,
                      "rollout/released": self.released, "rollout/refused": self.refused,
                      "rollout/weights_superseded": self.superseded,
                      "rollout/in_flight": sum(self.pool.in_flight),
                      # this process's CPU seconds since generation began besides weight updates (requests,
                      # streams, agents, rewards: sim calibrate's per-request cost)
                      "rollout/cpu_s": time.process_time() - self._cpu0 - self._update_cpu,
                      **self.gate.stats(), **self.pool.stats()})
        stats.update(await self._engine_metrics())
        logger.info("loaded weights v%d in %.2fs", version, stats["sync/update_s"])
        if self.metrics is not None:
            self.metrics.log(stats, step=version)

    async def _engine_metrics(self) -> dict[str, float]:
        """engine/* metrics summed over the servers that report them (the embedded engine does)."""
        total: dict[str, float] = {}
        live = [s.client for s in self.pool.servers if s.in_rotation]
        for client in live:
            fetch = getattr(client, "metrics", None)
            if fetch is None:
                continue
            try:
                for key, value in (await fetch()).items():
                    if key.startswith("engine/") and isinstance(value, (int, float)):
                        total[key] = total.get(key, 0.0) + float(value)
            except Exception as exc:  # metrics are best effort; never stop the run for them
                logger.debug("no metrics from %s: %s", client.address, exc)
        if len(live) > 1 and "engine/prefix_hit_rate" in total:
            total["engine/prefix_hit_rate"] /= len(live)
        return total

    async def _control_loop(self) -> None:
        async for msg in self.controls:
            kind = msg.get("kind")
            if kind == "weights":
                await self.apply_weights(msg)
            elif kind == "release":  # consumed without a version spent on them: room for as many more
                self.gate.release(int(msg.get("n", 0)))
                self.released += int(msg.get("n", 0))
                logger.log(logging.DEBUG if msg.get("quiet") else logging.WARNING,
                           "trainer released %s trajectories from the staleness count (%s)", msg.get("n"),
                           msg.get("reason", ""))
            elif kind == "pace":  # what the trainer found ready when it asked for its last batch
                self.gate.pace(int(msg.get("buffered", 0)))
            elif kind == "stop":
                self.final_version = int(msg.get("final_version", self.gate.version))
                logger.info("trainer finished at version %s: stopping rollout", self.final_version)
                self._stop.set()
                return
            else:
                logger.warning("ignoring unknown control message kind %r", kind)
        self._stop.set()

    async def run(self, seed: int) -> None:
        """Produce groups until the trainer says stop (or the control channel closes)."""
        self._seed = seed
        self._cpu0, self._update_cpu = time.process_time(), 0.0
        if self.periodic_eval is not None:
            self.periodic_eval.started = time.perf_counter()  # the training clock starts with generation
        if self.metrics is not None:  # when generation began: whole-run throughput is measured from here
            self.metrics.log({"rollout/generation_started": 1.0}, step=0)
        samples = self._samples(seed)
        if self._own_pool:
            self.pool.start()
        admit = asyncio.create_task(self._admit_loop(samples))
        control = asyncio.create_task(self._control_loop())
        for task in (admit, control):
            task.add_done_callback(self._done)
        try:
            await self._stop.wait()
        finally:  # stopped, or cancelled (SIGTERM): no group may outlive the queue client and files it writes to
            admit.cancel()
            control.cancel()
            pending = list(self._tasks)
            unfinished = sorted(self._running)
            for t in [*pending, *self._attempts]:
                t.cancel()
            await asyncio.gather(admit, control, *pending, *self._attempts, return_exceptions=True)
            if pending:
                logger.info("abandoned %d unfinished groups at the end of the run", len(pending))
                if self.ledger is not None:
                    # at the end of the run their prompts are reported; a side stopped mid-run leaves
                    # them to the next one, which generates them again
                    self.ledger.record("abandoned_groups", count=len(pending),
                                       prompts=unfinished if self.final_version is not None else [])
            if self.periodic_eval is not None:
                await self.periodic_eval.close()
            if self.tracer is not None:
                self.tracer.close()
            if self._own_pool:
                await self.pool.close(close_clients=False)
        if self._error is not None:
            raise self._error
