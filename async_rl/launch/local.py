"""`async-rl run`: trainer and rollout (with its generation servers) as supervised local processes.

The launcher supervises the trainer and the rollout process; the rollout process owns its
generation servers (`rollout.num_servers`) and restarts one whose process dies, on the same
port (async_rl/launch/server_keeper.py). Before anything starts, async_rl.placement decides the GPU
pools (`child_launches`): the trainer process gets its pool's GPUs (its ranks are its own
children, rank r on cuda:r), the rollout process none (CUDA_VISIBLE_DEVICES="" where the
machine has GPUs) and the slots of the servers it starts. Supervision (`supervise.*`):

- A child that dies with a non-zero exit code or a signal is restarted after a backoff, at
  most `supervise.max_restarts` times per component; the trainer restarts with
  `trainer.resume=true` (from its newest checkpoint) on the same `transport.addr`, and the
  rollout process restarts with it: a fresh rollout side joins at the trainer's restored
  version, where the running one holds weights and staleness accounting of steps the trainer
  will train again. Each restart is logged with its cause and appended to
  `run_dir/restarts.jsonl`; the summary counts them. Once a component's budget is spent, the
  next crash stops everything and the run fails with one line saying why (as with 0 restarts).
- A child that dies before its first start in this launch got through (`async_rl.launch.common.mark_up`:
  the trainer's model built and queue bound, the rollout side's servers ready and joined) is
  not restarted: it failed on its config or the machine, and would fail the same way again.
- A child that exits 0 is done. A rollout process that crashes after the trainer finished is
  not restarted (nothing would consume its data).
- SIGTERM to the launcher drains: no more restarts; the trainer gets SIGTERM, finishes its
  current step, checkpoints and tells the rollout side to stop (async_rl/trainer/drain.py `Drain`);
  after `supervise.drain_timeout_s` (or a second SIGTERM) whatever still runs is stopped. The
  launcher then prints where the newest checkpoint is and exits 143 (128 + SIGTERM, as a
  terminated job: a scheduler sees it did not finish, and `trainer.resume=true` continues it).
- Ctrl-C (SIGINT) stops every process at once and exits 130, as before.
"""

from __future__ import annotations

import logging
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import Any

from async_rl.config import Config, save_config
from async_rl.placement import TRAINER, Placement, for_process
from async_rl.trainer.checkpoint import latest_checkpoint
from async_rl.utils.ledger import LEDGERS, audit
from async_rl.utils.metrics import read_jsonl
from async_rl.trainer.backends import get_backend
from async_rl.trainer.best_checkpoint import BEST_DIR, read_best
from async_rl.launch.common import place_here, up_file, with_free_port
from async_rl.launch.procs import child_cause, child_error, spawn, stop_all, with_overrides
from async_rl.launch.supervision import RESTARTS_FILE, RestartBudget, restart_lines

logger = logging.getLogger(__name__)

# the launcher's children, in start order; a restarted trainer resumes from its newest checkpoint
TARGETS = {"trainer": "async_rl.launch.trainer_proc:trainer_main",
           "rollout": "async_rl.launch.rollout_proc:rollout_main"}
SIGTERM_EXIT = 128 + signal.SIGTERM


class RunFailed(RuntimeError):
    """A child process of the run died (and its restart budget is spent)."""


class Drained(SystemExit):
    """The run stopped on SIGTERM after draining: exit code 143."""

    def __init__(self, message: str):
        super().__init__(SIGTERM_EXIT)
        self.message = message


def child_launches(cfg: Config, plan: Placement) -> dict[str, tuple[Config, dict[str, str], dict]]:
    """What each child of TARGETS is started with: (config, environment added, keyword arguments)."""
    trainer_kwargs = {"gpu_memory_fraction": plan.trainer.memory_fraction} if plan.trainer.memory_fraction else {}
    return {"trainer": (for_process(cfg, TRAINER, plan.trainer), plan.trainer.env(), trainer_kwargs),
            "rollout": (cfg, plan.cpu.env(), {"servers": [s.to_wire() for s in plan.servers]})}


class Supervisor:
    """Starts the trainer and the rollout process, restarts them when they crash, drains on SIGTERM."""

    def __init__(self, cfg: Config, finish_s: float, launches: dict[str, tuple[Config, dict[str, str], dict]]):
        self.cfg, self.finish_s, self.launches = cfg, finish_s, launches
        self.budget = RestartBudget(cfg)
        self.procs: dict[str, Any] = {}
        self.due: dict[str, float] = {}  # component -> when it restarts (time.monotonic)
        self.sigterms = 0
        self._trainer_done_at: float | None = None

    def start(self, name: str, resume: bool = False) -> None:
        cfg, env, kwargs = self.launches[name]
        cfg = with_overrides(cfg, trainer={"resume": True}) if resume else cfg
        self.procs[name] = spawn(name, TARGETS[name], cfg, env=env, **kwargs)

    def stop(self) -> None:
        self.due.clear()
        stop_all(list(self.procs.values()))

    def on_sigterm(self, signum: int, frame: Any) -> None:
        self.sigterms += 1

    def run(self) -> bool:
        """Supervise until the run ends; True when it ended by draining on SIGTERM."""
        for name in TARGETS:
            self.start(name)
        while not self.sigterms:
            if self.poll():
                return False
            time.sleep(0.2)
        self.drain()
        return True

    def poll(self) -> bool:
        """Restart what is due, handle what died; True once the run is over."""
        now = time.monotonic()
        if self._trainer_finished():
            self.due.pop("rollout", None)  # nothing would consume its data
        for name, at in list(self.due.items()):
            if now >= at:
                del self.due[name]
                self.start(name, resume=name == "trainer")
        for name, p in list(self.procs.items()):
            if name not in self.due and not p.is_alive() and p.exitcode != 0:
                self.crashed(name, p)
        trainer, rollout = self.procs["trainer"], self.procs["rollout"]
        if "trainer" in self.due or trainer.is_alive():
            return False
        self._trainer_done_at = self._trainer_done_at or now
        if not rollout.is_alive():
            return True
        if now - self._trainer_done_at > self.finish_s:
            logger.warning("rollout did not finish %.0fs after the trainer; stopping it", self.finish_s)
            self.stop()
            return True
        return False

    def crashed(self, name: str, proc: Any) -> None:
        error = child_error(self.cfg, name, proc)
        if self._trainer_finished():
            self.stop()
            raise RunFailed(error)  # nothing would consume a restarted rollout side's data
        if not up_file(self.cfg.run_dir, name).exists():  # a bad config or machine: the same again on restart
            self.stop()
            raise RunFailed(f"{error}; it failed while starting, so it was not restarted")
        if not self.budget.allow(name):
            self.stop()
            raise RunFailed(self.budget.spent(name, error))
        self.due[name] = time.monotonic() + self.budget.record(name, child_cause(self.cfg, name, proc))
        if name == "trainer":
            self._restart_rollout_with_trainer()

    def _trainer_finished(self) -> bool:
        return "trainer" not in self.due and self.procs["trainer"].exitcode == 0

    def _restart_rollout_with_trainer(self) -> None:
        if latest_checkpoint(Path(self.cfg.run_dir) / "checkpoints") is None:
            logger.warning("no checkpoint under %s yet: the trainer starts again from step 0",
                           Path(self.cfg.run_dir) / "checkpoints")
        if "rollout" in self.due:
            return
        stop_all([self.procs["rollout"]])
        self.budget.record("rollout", "the trainer restarts: a fresh rollout side joins at its restored version",
                           counted=False)
        self.due["rollout"] = self.due["trainer"]

    def drain(self) -> None:
        """SIGTERM: the trainer finishes its step and checkpoints; then everything stops."""
        timeout = self.cfg.supervise.drain_timeout_s
        logger.warning("SIGTERM: draining (no more restarts; the trainer finishes its step and checkpoints, "
                       "at most %.0fs: supervise.drain_timeout_s; SIGTERM again stops everything now)", timeout)
        self.due.clear()
        deadline = time.monotonic() + timeout
        trainer = self.procs["trainer"]
        if trainer.is_alive():
            trainer.terminate()
        self._wait([trainer], deadline)
        if trainer.exitcode == 0:  # drained: it told the rollout side to stop
            self._wait(list(self.procs.values()), deadline)
        self.stop()

    def _wait(self, procs: list[Any], deadline: float) -> None:
        terms = self.sigterms
        while any(p.is_alive() for p in procs) and time.monotonic() < deadline and self.sigterms == terms:
            time.sleep(0.2)

    def drained_message(self) -> str:
        ckpt = latest_checkpoint(Path(self.cfg.run_dir) / "checkpoints")
        where = (f"newest checkpoint {ckpt}; continue the run with trainer.resume=true" if ckpt is not None
                 else "no checkpoint was written")
        return f"stopped on SIGTERM after draining: {where}"


def summary(cfg: Config) -> list[str]:
    lines = []
    rows = read_jsonl(Path(cfg.run_dir) / "metrics.jsonl")
    rollout_rows = read_jsonl(Path(cfg.run_dir) / "rollout_metrics.jsonl")
    if rows:
        k = max(1, min(3, len(rows) // 3))
        first = sum(r.get("train/reward_mean") or 0 for r in rows[:k]) / k
        last = sum(r.get("train/reward_mean") or 0 for r in rows[-k:]) / k
        lines.append(f"train reward mean: first {k} steps {first:.3f} -> last {k} steps {last:.3f}")
        lines.append(f"max staleness trained: {max(r.get('train/staleness_max') or 0 for r in rows)}; "
                     f"dropped stale: {sum(r.get('train/dropped_stale') or 0 for r in rows)}; "
                     f"interrupted trajectories: {sum(r.get('rollout/interrupted') or 0 for r in rows)}")
        lines.append(wall_line(rows, rollout_rows))
    pool = rollout_rows[-1:]
    if pool and pool[0].get("pool/servers", 1) > 1:
        p = pool[0]
        lines.append(f"generation servers: {p['pool/servers']}, in rotation at the end: {p['pool/in_rotation']}; "
                     f"fenced {p['pool/fenced_total']} times, out of rotation {p['pool/unhealthy_total']} times; "
                     f"requests moved to another server: {p['pool/reissued']}")
    return lines + eval_lines(cfg) + restart_lines(cfg.run_dir) + ledger_lines(cfg.run_dir)


def wall_line(rows: list[dict], rollout_rows: list[dict]) -> str:
    """Wall-clock time of training: from the first generation (or, without the rollout side's rows, the
    start of the first train step) to the end of the last step; the time inside steps beside it."""
    in_steps = sum(r.get("timing/step_s") or 0 for r in rows)
    start = next((r["time"] for r in rollout_rows if "rollout/generation_started" in r), None)
    since = "the first generation"
    if start is None:
        start, since = rows[0]["time"] - (rows[0].get("timing/step_s") or 0), "the first train step"
    return (f"wall time: {rows[-1]['time'] - start:.1f}s from {since} to the end of the last of {len(rows)} "
            f"train steps ({in_steps:.1f}s inside train steps)")


def eval_lines(cfg: Config) -> list[str]:
    """Held-out accuracy before and after, the curve during training, and the time to each of
    `task.eval_targets`."""
    lines = []
    all_evals = read_jsonl(Path(cfg.run_dir) / "eval.jsonl")
    evals = {r["when"]: r for r in all_evals}
    if "before" in evals and "after" in evals:
        lines.append(f"greedy accuracy on {evals['before']['eval/n']} held-out problems (none trained on): "
                     f"before {evals['before']['eval/accuracy']:.3f} -> after {evals['after']['eval/accuracy']:.3f}")
    periodic = [r for r in all_evals if r["when"] == "periodic"]
    if periodic:
        curve = ", ".join(f"v{r['step']} {r['eval/accuracy']:.2f}" for r in periodic)
        lines.append(f"accuracy during training: {curve}")
        if "eval/val_accuracy" in periodic[0]:
            curve = ", ".join(f"v{r['step']} {r['eval/val_accuracy']:.2f}" for r in periodic)
            lines.append(f"validation accuracy during training ({periodic[0]['eval/val_n']} other problems): {curve}")
        for target in cfg.task.eval_targets:
            hit = next((r for r in periodic if r["eval/accuracy"] >= target), None)
            lines.append(f"time to accuracy >= {target:.2f}: " + (
                f"{hit['timing/train_wall_s']:.0f}s of training, wall clock (version {hit['step']})" if hit
                else "not reached"))
    return lines + best_lines(cfg.run_dir)


def best_lines(run_dir: str) -> list[str]:
    """Which version the run kept as its best, what it was chosen on, and where it is."""
    best = read_best(run_dir)
    if best is None:
        return []
    where = Path(run_dir) / BEST_DIR
    if best["chosen_on"] == "validation":
        how = (f"validation accuracy {best['val_accuracy']:.3f}, test accuracy {best['test_accuracy']:.3f} "
               "(chosen on the validation set, scored on the test set)")
    else:
        how = (f"test accuracy {best['test_accuracy']:.3f} (chosen on the test set itself: the task has no "
               "validation set, task.val_size)")
    return [f"best version: v{best['policy_version']}, {how}; kept at {where} (a Hugging Face model directory)"]


def ledger_lines(run_dir: str) -> list[str]:
    """What became of every trajectory produced (the ledger's audit), for the run summary."""
    try:
        result = audit([run_dir])
    except ValueError:  # no ledger (the rollout side writes into another run directory)
        return []
    return ["trajectories: " + result.lines()[0].replace("=", " ")
            + f"; lost {len(result.lost_ids)}, trained twice {len(result.duplicated_ids)}, invented "
            f"{len(result.invented_ids)}; prompts lost "
            f"{len(result.lost_prompts)}, trained twice {len(result.duplicated_prompts)} (`async-rl audit {run_dir}`)",
            *(line for line in result.lines()[2:] if line.startswith("refused"))]


def run_local(cfg: Config) -> list[str]:
    get_backend(cfg.trainer.backend).check(cfg)  # every trainer rank runs here: fail before starting any
    plan = place_here(cfg)  # the GPU pools, or one error line naming the key
    cfg = with_overrides(cfg, transport={"addr": with_free_port(cfg.transport.addr)})
    save_config(cfg, cfg.run_dir)
    for stale in ("metrics.jsonl", "eval.jsonl", "rollout_metrics.jsonl", *LEDGERS):
        if not cfg.trainer.resume:  # a resumed run keeps its history (the trainer trims what it redoes)
            (Path(cfg.run_dir) / stale).unlink(missing_ok=True)
    if not cfg.trainer.resume:  # an earlier run's best is not this one's
        shutil.rmtree(Path(cfg.run_dir) / BEST_DIR, ignore_errors=True)
    (Path(cfg.run_dir) / RESTARTS_FILE).unlink(missing_ok=True)  # the restart budget is this launch's
    for name in TARGETS:
        up_file(cfg.run_dir, name).unlink(missing_ok=True)  # restarted only once up in this launch
    sup = Supervisor(cfg, finish_s=cfg.rollout.connect_timeout_s + 300, launches=child_launches(cfg, plan))
    previous = signal.signal(signal.SIGTERM, sup.on_sigterm)
    try:
        drained = sup.run()
    except KeyboardInterrupt:
        sup.stop()
        raise
    finally:
        signal.signal(signal.SIGTERM, previous)
    if drained:
        for line in summary(cfg):
            print(line, flush=True)
        print(sup.drained_message(), file=sys.stderr, flush=True)
        raise Drained(sup.drained_message())
    return summary(cfg)
