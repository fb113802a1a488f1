"""Process-wide logging set-up: a log file per process in the run directory, warnings on the console."""

from __future__ import annotations

import logging
import sys
from pathlib import Path


def setup_logging(level: str, run_dir: str | Path | None, name: str, console_level: str | None = None) -> None:
    root = logging.getLogger()
    root.handlers.clear()
    root.setLevel(level)
    fmt = logging.Formatter(f"%(asctime)s {name} %(levelname)s %(name)s: %(message)s", "%H:%M:%S")
    console = logging.StreamHandler(sys.stderr)
    console.setLevel(console_level or level)
    console.setFormatter(fmt)
    root.addHandler(console)
    if run_dir is not None:
        log_dir = Path(run_dir) / "logs"
        log_dir.mkdir(parents=True, exist_ok=True)
        fh = logging.FileHandler(log_dir / f"{name}.log")
        fh.setFormatter(fmt)
        root.addHandler(fh)
    for noisy in ("httpx", "httpcore", "uvicorn.access", "urllib3"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def one_line(exc: BaseException) -> str:
    """The first line of an exception's message (its type's name when it has none): how errors are reported."""
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
