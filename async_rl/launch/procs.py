"""Child processes: start them, wait for them to be ready, and turn failures into one line.

Every child runs `child_entry`, which sets up logging into the run directory and turns
any exception into a single `error: ...` line (the traceback goes to the child's log
file) plus an `<name>.error` file the parent reads to report why a child died.

A target is named "module:function" and imported in the child. Children are forked from a
fork server (multiprocessing's "forkserver") that has imported torch, transformers and the
children's modules once (`PRELOAD`): a child starts in milliseconds instead of paying those
imports (~5 s each, and three processes at once on a small machine). `prestart()` starts that
server early so its imports overlap the parent's own start-up, and a child that starts children
of its own (the rollout side its servers) asks the same server (`_adopt_fork_server`). Nothing
in `PRELOAD` may touch CUDA at import: a child forked from a process that did cannot use it.
"""

from __future__ import annotations

import asyncio
import ctypes
import dataclasses
import importlib
import logging
import multiprocessing as mp
import multiprocessing.forkserver as mp_forkserver
import os
import select
import signal
import threading
import time
import traceback
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

from async_rl.config import Config
from async_rl.utils.exits import exit_now
from async_rl.utils.logs import one_line, setup_logging
from async_rl.utils.pids import pid_alive

logger = logging.getLogger(__name__)
_CTX = mp.get_context("forkserver")
PRELOAD = ["async_rl.launch.trainer_proc", "async_rl.launch.rollout_proc", "async_rl.launch.serve",
           "async_rl.launch.trainer_ranks",
           "transformers.modeling_utils", "transformers.models.llama.modeling_llama"]  # what building a model imports
_CTX.set_forkserver_preload(PRELOAD)
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def prestart() -> None:
    """Start the fork server now: it imports `PRELOAD` in the background while this process goes on."""
    mp_forkserver.ensure_running()


def stop_fork_server() -> None:
    """Kill the fork server this process started, if any, once its command has ended (its children, if
    it started any, already stopped). Left alone, the server holds the command's output open until it
    ends: after a refusal its imports go on for nothing, and after a run it leaves only when it sees its
    parent gone, through the ~1.4 s of an interpreter's teardown with torch and transformers loaded
    (2-core Xeon). A caller that reads the command's output waited that long after its last line."""
    pid = getattr(mp_forkserver._forkserver, "_forkserver_pid", None)
    if pid:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def error_file(run_dir: str | Path, name: str) -> Path:
    """Where child `name` writes its one-line error (`child_entry`), for its starter to report."""
    return Path(run_dir) / "logs" / f"{name}.error"


def _adopt_fork_server() -> None:
    """In a child forked by the fork server: die with that server, and start children of its own from
    it. The server is the child's OS parent, which reports the child's exit to whoever started it: a
    child outliving its server would look dead (exit code 255) to its starter while still running.
    It inherited the server's address and a handle on its "alive" pipe; only the server's pid, which
    `ensure_running` checks and only the server's own parent can wait for, is missing."""
    server = mp_forkserver._forkserver
    if not (getattr(server, "_forkserver_address", None) and getattr(server, "_forkserver_alive_fd", None) is not None):
        return  # not forked by a fork server
    try:
        ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux
        pass
    server.ensure_running = lambda: None


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def run_async(main: Coroutine[Any, Any, None]) -> None:
    """`asyncio.run(main)` in a child: SIGTERM cancels `main`, whose own `finally` blocks then close
    streams and sockets inside the running loop, and the child exits 130 as on KeyboardInterrupt.
    (The KeyboardInterrupt of `_interrupt`, raised at whatever point the loop was, leaves open
    HTTP streams to a loop that is shutting down, which logs their tracebacks on the console.)"""
    async def guarded() -> bool:
        task, loop = asyncio.current_task(), asyncio.get_running_loop()
        stopped = False

        def on_sigterm() -> None:
            nonlocal stopped
            stopped = True
            task.cancel()

        loop.add_signal_handler(signal.SIGTERM, on_sigterm)
        try:
            await main
        except asyncio.CancelledError:
            if not stopped:
                raise
        finally:
            loop.remove_signal_handler(signal.SIGTERM)
            signal.signal(signal.SIGTERM, _interrupt)
        return stopped

    if asyncio.run(guarded()):
        raise KeyboardInterrupt


def _watch_parent(parent: int) -> None:
    """A child never outlives the process that started it (not its OS parent, the fork server): when
    that process ends, stop gracefully, then for good."""
    try:
        select.select([os.pidfd_open(parent)], [], [])  # readable once the process has ended, zombie or reaped
    except ProcessLookupError:
        pass  # already gone
    except (AttributeError, OSError):  # no pidfd here (not Linux, or an old kernel): poll
        while pid_alive(parent):
            time.sleep(1.0)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(15.0)
    os._exit(1)


def resolve_target(target: str) -> Callable[..., None]:
    """The function a "module:function" target names, imported here."""
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)


def child_entry(name: str, target: str, cfg: Config, kwargs: dict, env: dict[str, str], parent: int) -> None:
    """Body of every child process. `env` is the environment of the process that started it (`parent`),
    as a spawned child would inherit it, with its own additions (its CUDA_VISIBLE_DEVICES from
    async_rl.placement): set before anything runs, so CUDA, initialised later, only ever sees the
    GPUs placed here."""
    os.environ.clear()
    os.environ.update(env)
    _adopt_fork_server()
    threading.Thread(target=_watch_parent, args=(parent,), name="watch-parent", daemon=True).start()
    setup_logging(cfg.log.level, cfg.run_dir, name, console_level="WARNING")
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the parent stops us in order
    err = error_file(cfg.run_dir, name)
    err.unlink(missing_ok=True)
    pid_file(cfg.run_dir, name).write_text(str(os.getpid()))  # who to signal (tests, operators); a restart rewrites it
    try:
        resolve_target(target)(cfg, **kwargs)
    except KeyboardInterrupt:
        exit_now(130)
    except BaseException as exc:  # report every failure as one line; the traceback goes to the log file
        root = logging.getLogger()
        for h in list(root.handlers):
            if not isinstance(h, logging.FileHandler):
                root.removeHandler(h)
        logging.getLogger(name).error("fatal: %s\n%s", one_line(exc), traceback.format_exc())
        err.write_text(one_line(exc))
        exit_now(2)
    exit_now(0)  # no interpreter teardown (~1 s with torch loaded): whoever waits for this process goes on


def spawn(name: str, target: str, cfg: Config, *, env: dict[str, str] | None = None, **kwargs) -> mp.Process:
    """Start `target` ("module:function", called as function(cfg, **kwargs)) as child process `name`,
    with `env` added to its environment."""
    if not isinstance(target, str) or target.count(":") != 1:
        raise ValueError(f"spawn target: expected 'module:function', got {target!r}")
    args = (name, target, cfg, kwargs, {**os.environ, **(env or {})}, os.getpid())
    proc = _CTX.Process(target=child_entry, args=args, name=name, daemon=False)
    proc.start()
    return proc


def pid_file(run_dir: str | Path, name: str) -> Path:
    return Path(run_dir) / "logs" / f"{name}.pid"


def exit_cause(exitcode: int | None) -> str:
    """"exited with code 2", or "killed by SIGKILL" for a child a signal ended."""
    if exitcode is not None and exitcode < 0:
        try:
            return f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exited with code {exitcode}"


def child_cause(cfg: Config, name: str, proc: mp.Process) -> str:
    """Why a child died: its one-line error, else how it exited."""
    f = error_file(cfg.run_dir, name)
    return f.read_text().strip() if f.is_file() else exit_cause(proc.exitcode)


def named_error(cfg: Config, name: str, why: str) -> str:
    """The one line a failed process ends a run with: its name, why, and where its log is."""
    return f"{name}: {why} (log: {Path(cfg.run_dir) / 'logs' / (name + '.log')})"


def child_error(cfg: Config, name: str, proc: mp.Process) -> str:
    return named_error(cfg, name, child_cause(cfg, name, proc))


def stop_all(procs: list[mp.Process], grace_s: float = 20.0) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + grace_s
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join(2)


def server_name(index: int) -> str:
    """Process and log name of generation server `index` ("server", then "server1", "server2", ...)."""
    return "server" if index == 0 else f"server{index}"


def start_server(cfg: Config, index: int = 0, env: dict[str, str] | None = None, timeout_s: float = 600.0,
                 starting: Any = None) -> tuple[mp.Process, str]:
    """Start embedded generation server `index` as a child (with `env`: its GPU); return it and its URL once it
    serves. `starting` (`async_rl.launch.external_server.Starting`) tracks it from its spawn and can cut the wait short."""
    name = server_name(index)
    ready = Path(cfg.run_dir) / f"{name}_address"
    ready.unlink(missing_ok=True)
    proc = spawn(name, "async_rl.launch.serve:serve_main", cfg, env=env, ready_file=str(ready))
    pause = time.sleep
    if starting is not None:
        starting.track(proc)
        pause = starting.sleep
    try:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if ready.is_file() and ready.read_text().strip():
                return proc, ready.read_text().strip()
            if not proc.is_alive():
                raise RuntimeError(child_error(cfg, name, proc))
            pause(0.1)
        raise RuntimeError(f"generation server {name} did not start within {timeout_s:.0f}s")
    except BaseException:
        stop_all([proc])
        raise


def with_overrides(cfg: Config, **changes) -> Config:
    """A copy of `cfg` with dotted-free top-level or nested changes: with_overrides(cfg, rollout={...})."""
    out = cfg
    for key, value in changes.items():
        if isinstance(value, dict):
            out = dataclasses.replace(out, **{key: dataclasses.replace(getattr(out, key), **value)})
        else:
            out = dataclasses.replace(out, **{key: value})
    return out
