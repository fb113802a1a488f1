"""The command line in tests: as a user runs it (`python -m async_rl.launch.cli`, a child process), and in this
process for bad input that stops before any process starts.

A child pays ~3 s of imports (torch, transformers) before it reads its arguments; a suite with
dozens of bad-input cases spent minutes on that alone. `cli_here` calls the same `async_rl.launch.cli.main`
with the same arguments from the repository root and captures what it prints, so those cases
check the same words and exit code in milliseconds. `test_cli_errors.py` keeps one case of every
kind on the real entry point (`cli`), so what only a child shows (a warning at import, a traceback
from start-up) still fails a test.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DEBUG = str(ROOT / "configs" / "debug_cpu.yaml")
FINISHED_STEPS = 5  # the steps of the session's finished run (conftest.py)


def running(pid: int) -> bool:
    """`pid` is a process that has not exited: a zombie its parent has yet to reap counts as gone (from /proc)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def cli(*args: str, timeout: float = 400, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`python -m async_rl.launch.cli ARGS` from the repository root, as a user runs it."""
    return subprocess.run([sys.executable, "-m", "async_rl.launch.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env=env)


def cli_here(*args: str) -> subprocess.CompletedProcess:
    """`async_rl.launch.cli.main(ARGS)` in this process, from the repository root: its exit code and what it printed.
    Only for input the launcher refuses before it starts a process: the logging set-up, the signal
    handlers and the working directory it changes are put back."""
    from async_rl.launch.cli import main

    out, err = io.StringIO(), io.StringIO()
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    sigs = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(list(args))
            except SystemExit as exc:  # argparse
                code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    finally:
        os.chdir(cwd)
        for handler in root.handlers:
            if handler not in handlers:
                handler.close()
        root.handlers[:] = handlers
        root.setLevel(level)
        for s, handler in sigs.items():
            signal.signal(s, handler)
    return subprocess.CompletedProcess(["async_rl.launch.cli", *args], code, out.getvalue(), err.getvalue())
