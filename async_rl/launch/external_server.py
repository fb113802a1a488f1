"""Generation servers that are other programs (SGLang, vLLM): started under a guard, tracked from the first moment.

    proc = start_guarded(cfg, "server", command, extra_env, starting)   # an mp.Process, at once
    wait_healthy(cfg, proc, url, starting, timeout_s=900)              # returns once GET /health is 200

The program does not run as our child directly: a guard process (`guard_main`, started like
every child of a run by `async_rl.launch.procs.spawn`) starts it in a session of its own and waits for
it. So the server is one `mp.Process` to everyone who holds it (stop_all, the server keeper,
the Ray host read its `name`, `exitcode`, `is_alive()`), from the moment it is spawned, not
once it is healthy. The guard
- dies with its starter (`procs` watches the starter's pid), and stops the server's whole
  process group when it goes (SIGTERM, then SIGKILL after a grace period);
- makes the server die with it even when the guard itself is killed (PR_SET_PDEATHSIG, set from
  the guard's main thread, the one that forked the server);
- reports the server's exit code and the last lines of its log as its one-line error.
`wait_healthy` polls /health until it answers 200; a server that exits first, is not up in
time, or whose start is abandoned (`Starting.abandon`: Ctrl-C or SIGTERM of the starter) is
stopped before the error is raised. A real engine takes minutes to load and compile: the rollout
side connects to the trainer before it starts its servers, so the trainer never waits for them.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from async_rl.config import Config
from async_rl.launch.procs import spawn, stop_all

logger = logging.getLogger(__name__)
_PR_SET_PDEATHSIG = 1  # linux/prctl.h
STOP_GRACE_S = 30.0  # how long a server may take to stop after SIGTERM before its group is killed


class StartAbandoned(RuntimeError):
    """The starter gave up on starting its servers (it is stopping)."""


class Starting:
    """The servers one starter is starting: each tracked as soon as it is spawned, all stopped at once by
    `abandon` (the starter was interrupted), and every wait for them cut short then."""

    def __init__(self) -> None:
        self.procs: list[Any] = []
        self._abandoned = threading.Event()
        self._lock = threading.Lock()

    def track(self, proc: Any) -> Any:
        with self._lock:
            self.procs.append(proc)
        if self._abandoned.is_set():  # spawned in the instant the start was abandoned
            stop_all([proc])
            raise StartAbandoned("the start of the generation servers was abandoned")
        return proc

    def sleep(self, seconds: float) -> None:
        if self._abandoned.wait(seconds):
            raise StartAbandoned("the start of the generation servers was abandoned")

    def abandon(self) -> None:
        self._abandoned.set()
        with self._lock:
            procs = list(self.procs)
        stop_all(procs)


def log_tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _die_with_guard() -> None:  # runs in the forked server before exec
    try:
        ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):  # not Linux
        pass


def _stop_group(popen: subprocess.Popen) -> None:
    for sig, wait_s in ((signal.SIGTERM, STOP_GRACE_S), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(popen.pid, sig)
        except ProcessLookupError:
            return
        try:
            popen.wait(wait_s)
        except subprocess.TimeoutExpired:
            continue
        try:  # the leader is gone; what it started in its group goes too
            os.killpg(popen.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        return


def guard_main(cfg: Config, command: list[str], extra_env: dict[str, str], log_path: str) -> None:
    """Body of the guard process: run `command` (its output appended to `log_path`) until it exits."""
    log = Path(log_path)
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("ab") as out:
        popen = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **extra_env},
                                 start_new_session=True, preexec_fn=_die_with_guard)
    try:
        code = popen.wait()
    finally:
        _stop_group(popen)  # on SIGTERM (KeyboardInterrupt here) or once it exited: nothing of it stays
    last = " | ".join(line.strip() for line in log_tail(log, 3).splitlines() if line.strip())
    raise RuntimeError(f"exited with code {code} (log: {log}): {last}")


def start_guarded(cfg: Config, name: str, command: list[str], extra_env: dict[str, str], starting: Starting, *,
                  what: str, env: dict[str, str] | None = None) -> Any:
    """Spawn the guard of server process `name` (`env`: its placement's variables), tracked by `starting`."""
    log_path = Path(cfg.run_dir) / "logs" / f"{name}.out"
    logger.info("starting %s: %s (output: %s)", what, " ".join(command), log_path)
    return starting.track(spawn(name, "async_rl.launch.external_server:guard_main", cfg, env=env, command=command,
                                extra_env=extra_env, log_path=str(log_path)))


def wait_healthy(cfg: Config, proc: Any, url: str, starting: Starting, *, what: str, timeout_s: float,
                 headers: dict[str, str] | None = None) -> None:
    """Return once `url`/health answers 200; otherwise stop `proc` and raise one error naming `what`."""
    from async_rl.launch.procs import child_cause

    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            if not proc.is_alive():
                raise RuntimeError(f"{what}: {child_cause(cfg, proc.name, proc)}")
            try:
                if httpx.get(f"{url}/health", timeout=5.0, trust_env=False, headers=headers).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            starting.sleep(1.0)
        raise RuntimeError(f"{what}: not healthy within {timeout_s:.0f}s (log: "
                           f"{Path(cfg.run_dir) / 'logs' / (proc.name + '.out')}):\n"
                           f"{log_tail(Path(cfg.run_dir) / 'logs' / (proc.name + '.out'))}")
    except BaseException:
        stop_all([proc])
        raise
