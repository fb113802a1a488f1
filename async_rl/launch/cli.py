"""The `async-rl` command line.

    async-rl run     --config C [key=value ...]   trainer + rollout + generation server, locally
    async-rl train   --config C [key=value ...]   the trainer side alone (binds transport.addr)
    async-rl rollout --config C [key=value ...]   the rollout side alone (connects to transport.addr)
    async-rl serve   --config C [key=value ...]   one generation server alone
    async-rl report  RUN_DIR [--out DIR]          PNG plots + one HTML page of a run (RUN_DIR/report)
    async-rl keys    --out DIR                    CURVE key pairs for transport.curve_keys_dir
    async-rl sim     --profile P --gpus 64 --eta 0,1,2,4,8 --split auto   predict the split and eta to run
    async-rl sim     calibrate RUN_DIR            a simulator profile measured on a run

Every failure the user can cause (missing config, unknown key, wrong type, unreachable
address, a child process dying) ends as one `error: ...` line and exit code 2.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from async_rl.config import Config, load_config, save_config
from async_rl.utils.exits import exit_now
from async_rl.utils.logs import setup_logging

logger = logging.getLogger("async_rl")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="async-rl", description="Asynchronous RL for language models.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, text in [("run", "trainer, rollout and a generation server as local processes"),
                       ("train", "the trainer side alone"), ("rollout", "the rollout side alone"),
                       ("serve", "one generation server alone")]:
        p = sub.add_parser(name, help=text, description=text)
        p.add_argument("--config", "-c", required=name not in ("run", "train"),
                       help="YAML config file (see configs/); with --resume, the run's own config.yaml")
        if name in ("run", "train"):
            p.add_argument("--resume", metavar="RUN_DIR", default=None,
                           help="continue the run in RUN_DIR from its newest checkpoint")
        p.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides, e.g. trainer.lr=1e-5")
    text = "PNG plots and one HTML page from a run directory's metrics"
    p = sub.add_parser("report", help=text, description=text)
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run's run_dir (holds metrics.jsonl)")
    p.add_argument("--out", "-o", default=None, help="where the report goes (default RUN_DIR/report)")
    text = "check a run's trajectory ledger: prints lost=N duplicated=N invented=N, exits 1 unless all are 0"
    p = sub.add_parser("audit", help=text, description=text)
    p.add_argument("run_dirs", metavar="RUN_DIR", nargs="+", help="the run's directory (both sides' when they differ)")
    text = "CURVE key pairs (trainer and rollout side) for transport.curve_keys_dir, and an engine.api_key token"
    p = sub.add_parser("keys", help=text, description=text)
    p.add_argument("--out", "-o", required=True, help="a new directory for the keys (never overwritten)")
    from async_rl.launch.sim_cmd import add_parser

    add_parser(sub)
    return parser


def _keys(out: str) -> int:
    from async_rl.transport.auth import create_keys

    for path in create_keys(out):
        print(f"wrote {path}", flush=True)
    print(f"trainer side needs server.key_secret and authorized_clients/, rollout side server.key and "
          f"client.key_secret; run with transport.curve_keys_dir={out}; generation servers on an address other "
          f"machines reach: engine.api_key=file:{out}/api_key", flush=True)
    return 0


def _report(run_dir: str, out: str | None) -> int:
    from async_rl.report import write_report

    report = write_report(run_dir, out)
    for line in report.skipped:
        print(f"not drawn: {line}", flush=True)
    print(f"report: {len(report.images)} plots and {report.index}", flush=True)
    return 0


def _audit(run_dirs: list[str]) -> int:
    from async_rl.utils.ledger import audit

    result = audit(run_dirs)
    for line in result.lines():
        print(line)
    for kind, ids in (("lost", result.lost_ids), ("duplicated", result.duplicated_ids),
                      ("invented", result.invented_ids)):
        if ids:
            print(f"{kind} ids (first 10): {', '.join(ids[:10])}")
    return 0 if result.ok else 1


def _load(args: argparse.Namespace) -> Config:
    resume = getattr(args, "resume", None)
    if resume is None:
        if args.config is None:
            raise ValueError("--config: required (or --resume RUN_DIR to continue a run)")
        return load_config(args.config, args.overrides)
    saved = Path(resume) / "config.yaml"
    if not saved.is_file():
        raise ValueError(f"--resume: {resume} is not a run directory (no config.yaml)")
    return load_config(args.config or saved, [*args.overrides, f"run_dir={resume}", "trainer.resume=true"])


def _check_standalone(cfg: Config, command: str) -> None:
    if command in ("train", "rollout") and cfg.transport.addr.endswith(":0"):
        raise ValueError(f"transport.addr: `async-rl {command}` needs a fixed address both sides agree on, "
                         f"e.g. transport.addr=tcp://127.0.0.1:5555 (got {cfg.transport.addr})")


def _placed_alone(cfg: Config, command: str) -> tuple[Config, dict[str, str], dict]:
    """One side started alone takes this machine's GPUs for itself (async_rl/placement.py): its process's
    config, environment and keyword arguments, or one error line before it starts."""
    from async_rl.placement import ROLLOUT, TRAINER, for_process
    from async_rl.launch.common import place_here
    from async_rl.launch.procs import with_overrides

    if command == "train":
        plan = place_here(cfg, (TRAINER,))
        return for_process(cfg, TRAINER, plan.trainer), plan.trainer.env(), {}
    if command == "rollout":
        plan = place_here(cfg, (ROLLOUT,))
        return cfg, plan.cpu.env(), {"servers": [s.to_wire() for s in plan.servers]}
    plan = place_here(with_overrides(cfg, rollout={"num_servers": 1, "server_addrs": []}), (ROLLOUT,))
    return for_process(cfg, ROLLOUT, plan.servers[0]), plan.servers[0].env(), {}


def _check_exposure(cfg: Config, command: str) -> None:
    """Closed by default, before any process starts: the queue this command binds, and the generation servers it
    starts, need a key where other machines reach them (async_rl/utils/exposure.py; each checks again as it binds)."""
    from async_rl.utils.exposure import check_queue, check_server

    if command in ("run", "train"):
        check_queue(cfg.transport.addr, cfg.transport.curve_keys_dir, cfg.transport.insecure)
    if command == "serve" or (command in ("run", "rollout") and not cfg.rollout.server_addrs):
        check_server(cfg.engine.host, cfg.engine.api_key, cfg.engine.insecure)


def _dispatch(command: str, cfg: Config) -> int:
    from async_rl.launch import procs
    from async_rl.launch.common import check_agents, pin_dtypes

    _check_exposure(cfg, command)
    if command != "run" or cfg.launcher == "local":  # this process starts the children: warm their fork server
        procs.prestart()
    if command in ("run", "rollout"):  # a local run's rollout side runs here; a Ray run's, on some node
        check_agents(cfg, prepare=command == "rollout" or cfg.launcher == "local")
    cfg, lines = pin_dtypes(cfg, command)
    for line in lines:
        print(line, flush=True)

    if command == "run":
        from async_rl.launch.launchers import LAUNCHERS

        for line in LAUNCHERS[cfg.launcher](cfg):
            print(line, flush=True)
        print(f"run directory: {cfg.run_dir}", flush=True)
        return 0
    _check_standalone(cfg, command)
    child_cfg, env, kwargs = _placed_alone(cfg, command)
    save_config(cfg, Path(cfg.run_dir))
    target = {"train": "async_rl.launch.trainer_proc:trainer_main",
              "rollout": "async_rl.launch.rollout_proc:rollout_main",
              "serve": "async_rl.launch.serve:serve_main"}[command]
    proc = procs.spawn(command if command != "serve" else "server", target, child_cfg, env=env, **kwargs)
    try:
        proc.join()
    except KeyboardInterrupt:
        procs.stop_all([proc])
        raise
    if proc.exitcode != 0:
        raise RuntimeError(procs.child_error(cfg, proc.name, proc))
    if command == "rollout":
        from async_rl.launch.local import summary

        for line in summary(cfg):
            print(line, flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "report":
            return _report(args.run_dir, args.out)
        if args.command == "keys":
            return _keys(args.out)
        if args.command == "audit":
            return _audit(args.run_dirs)
        if args.command == "sim":
            from async_rl.launch.sim_cmd import sim_main

            return sim_main(args)
        cfg = _load(args)
        setup_logging(cfg.log.level, cfg.run_dir, "launcher", console_level="WARNING")
        return _dispatch(args.command, cfg)
    except KeyboardInterrupt:
        print("interrupted: all processes stopped", file=sys.stderr)
        return 130
    except Exception as exc:  # one line for the user; details are in the run's logs
        from async_rl.launch.procs import one_line

        logger.debug("fatal", exc_info=True)
        print(f"error: {one_line(exc)}", file=sys.stderr)
        return 2


def entry(argv: list[str] | None = None) -> None:
    """The `async-rl` command (`argv`: its arguments, default the process's): `main`, then out without the
    interpreter's teardown (async_rl/utils/exits.py). The scripts under launch/ call it with their own."""
    code = main(argv)
    procs = sys.modules.get("async_rl.launch.procs")  # imported by the commands that start processes
    if procs:  # its children have ended (or never started): the fork server has nothing left to do
        procs.stop_fork_server()
    exit_now(code)


if __name__ == "__main__":
    entry()
