"""The `python` tool: run model-written Python in a separate, confined process.

Each call starts `sandbox_runner.py` under the isolation chosen once per process (see
`ISOLATIONS`): bubblewrap where installed, else Linux namespaces through util-linux
`unshare` (either way: no network, the host file system read-only with only the episode's
scratch directory writable and the protected directories hidden, own pid space). Where the
machine allows neither, the tool is refused at start-up, unless its config names
`isolation: audit`: NO isolation, an audit hook in the child only. In every mode: rlimits on
CPU, address space, file size and processes, a wall-clock kill of the whole process group,
capped output, and every failure returned to the model as `ToolResult(error=True)` naming the
cause. Calls run as asyncio subprocesses, so many episodes share one event loop.

    tools:
      - name: python
        config: {timeout_s: 5, cpu_s: 3, memory_mb: 512, protected_dirs: [runs/my_run]}
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import secrets
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from async_rl.agent.tools.base import BaseTool, ToolResult, register_tool
from async_rl.agent.tools.isolation import ISOLATIONS, Isolation, detect_isolation, new_uid, python_paths
from async_rl.agent.tools.sandbox_process import RUNNER_PATH, describe_exit, run_sandboxed
from async_rl.agent.tools.sandbox_runner import inside

logger = logging.getLogger(__name__)


@dataclass(kw_only=True)
class PythonSandboxConfig:
    """Limits and places of the `python` tool (its YAML `config:` map)."""

    timeout_s: float = 10.0  # wall-clock limit of one call; the whole process group is killed at it
    cpu_s: int = 5  # CPU seconds per process (RLIMIT_CPU); the code gets SIGXCPU at the limit
    memory_mb: int = 1024  # address space per process (RLIMIT_AS)
    max_processes: int = 32  # processes and threads the code may have at once (RLIMIT_NPROC)
    max_file_mb: int = 64  # largest file the code may write (RLIMIT_FSIZE)
    max_output_chars: int = 4000  # stdout + stderr shown to the model; the middle is cut beyond this
    max_code_chars: int = 100_000  # longer code is refused without running
    max_concurrent: int = 16  # calls of this tool running at once; more wait for a slot
    scratch_root: str = ""  # per-episode scratch directories go here; "" = <system temp>/async_rl_sandbox
    protected_dirs: list[str] = field(default_factory=list)  # never readable from the code (e.g. the run dir)
    isolation: str = "auto"  # "auto" (bwrap, else unshare; refused if neither works) or bwrap | unshare | audit (NONE)
    python: str = ""  # interpreter that runs the code; "" = the one running this process

    def __post_init__(self) -> None:
        for key in ("timeout_s", "cpu_s", "memory_mb", "max_processes", "max_file_mb", "max_output_chars",
                    "max_code_chars", "max_concurrent"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"python tool config: {key} must be a positive number, got {value!r}")
        if not isinstance(self.protected_dirs, list) or not all(isinstance(d, str) for d in self.protected_dirs):
            raise ValueError(f"python tool config: protected_dirs must be a list of paths, got {self.protected_dirs!r}")
        if self.isolation != "auto" and self.isolation not in ISOLATIONS:
            raise ValueError(f"python tool config: isolation must be 'auto' or one of {sorted(ISOLATIONS)}, "
                             f"got {self.isolation!r}")
        self.cpu_s = max(1, int(self.cpu_s))
        self.scratch_root = os.path.realpath(self.scratch_root or os.path.join(tempfile.gettempdir(),
                                                                               "async_rl_sandbox"))
        self.protected_dirs = [os.path.realpath(d) for d in self.protected_dirs]
        self.python = self.python or sys.executable
        for d in self.protected_dirs:
            if inside(self.scratch_root, d):
                raise ValueError(f"python tool config: scratch_root {self.scratch_root} lies inside protected "
                                 f"dir {d}; put it elsewhere")


def _sandbox_env(scratch: str) -> dict[str, str]:
    """A small, fixed environment: nothing of this process's (tokens, keys) reaches the code."""
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": scratch, "TMPDIR": scratch, "LANG": "C.UTF-8",
            "LC_ALL": "C.UTF-8", "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


@register_tool("python")
class PythonTool(BaseTool):
    """Runs Python code in a sandbox; the model reads what it prints."""

    description = ("Run Python 3 code in a sandbox and return what it prints (stdout, then stderr). "
                   "No network; only the current directory is writable; each call is a fresh process.")
    parameters = {"type": "object", "required": ["code"],
                  "properties": {"code": {"type": "string",
                                          "description": "Python source; use print() to show results"}}}

    def __init__(self, **config: Any):
        super().__init__(**config)
        self.cfg = PythonSandboxConfig(**config)
        self._host: tuple[list[str], Isolation, bool] | None = None  # see prepare()
        self._scratch: dict[str, tuple[str, int | None]] = {}  # instance id -> (scratch dir, sandbox uid)
        self._slots: tuple[asyncio.AbstractEventLoop, asyncio.Semaphore] | None = None

    def prepare(self) -> None:
        """Ask the interpreter where it reads from, and pick the isolation mode this machine supports."""
        if self._host is not None:
            return
        expose = python_paths(self.cfg.python)
        for d in self.cfg.protected_dirs:
            if any(inside(p, d) for p in expose):
                raise ValueError(f"python tool config: protected dir {d} holds the Python installation "
                                 f"({self.cfg.python}); the code could not run")
        isolation = detect_isolation(self.cfg.isolation, self.cfg.python)
        drops_uid = isolation.drops_uid([*expose, self.cfg.scratch_root])
        if os.geteuid() == 0 and not drops_uid:
            logger.warning("python tool: root, no mount namespace, and Python or scratch_root is not reachable by "
                           "other users: the code keeps root's uid (no process limit; fork is refused instead)")
        self._host = (expose, isolation, drops_uid)

    @property
    def expose(self) -> list[str]:
        """The directories the interpreter reads from (kept reachable for the code's uid)."""
        self.prepare()
        return self._host[0]

    @property
    def isolation(self) -> Isolation:
        self.prepare()
        return self._host[1]

    @property
    def drops_uid(self) -> bool:
        """The code runs as a throw-away uid (root only)."""
        self.prepare()
        return self._host[2]

    def _slot(self) -> asyncio.Semaphore:
        loop = asyncio.get_running_loop()
        if self._slots is None or self._slots[0] is not loop:
            self._slots = (loop, asyncio.Semaphore(int(self.cfg.max_concurrent)))
        return self._slots[1]

    async def create(self, instance_id: str, **kwargs: Any) -> str:
        if instance_id not in self._scratch:
            uid = new_uid() if self.drops_uid else None
            root = Path(self.cfg.scratch_root)
            if not root.exists():
                root.mkdir(parents=True, exist_ok=True)
                root.chmod(0o711)  # a throw-away uid must reach its own directory, not list the others
            name = re.sub(r"[^A-Za-z0-9_.-]", "_", instance_id)[:64] + "-" + secrets.token_hex(4)
            scratch = root / name
            scratch.mkdir(mode=0o700)
            if uid is not None:
                os.chown(scratch, uid, uid)
            self._scratch[instance_id] = (str(scratch), uid)
        return instance_id

    def scratch_dir(self, instance_id: str) -> Path:
        """The episode's scratch directory (the code's working directory)."""
        return Path(self._scratch[instance_id][0])

    def _settings(self, scratch: str, uid: int | None) -> dict[str, Any]:
        c = self.cfg
        return {"scratch": scratch, "protected": c.protected_dirs, "expose": self.expose, "uid": uid,
                "cpu_s": c.cpu_s, "memory_bytes": int(c.memory_mb * 2**20), "file_bytes": int(c.max_file_mb * 2**20),
                "max_processes": int(c.max_processes), **self.isolation.runner_flags()}

    async def execute(self, instance_id: str, arguments: dict[str, Any]) -> ToolResult:
        code = arguments.get("code") if isinstance(arguments, dict) else None
        if not isinstance(code, str) or not code.strip():
            return ToolResult(error=True, text="python: the `code` argument must be a non-empty string of Python")
        if len(code) > self.cfg.max_code_chars:
            return ToolResult(error=True, text=f"python: code too long ({len(code)} characters; "
                                               f"max_code_chars={self.cfg.max_code_chars})")
        if instance_id not in self._scratch:
            return ToolResult(error=True, text=f"python: unknown instance {instance_id!r} (create() was not called "
                                               "or release() already ran)")
        scratch, uid = self._scratch[instance_id]
        settings = self._settings(scratch, uid)
        argv = [*self.isolation.prefix(settings), self.cfg.python, "-I", "-B", RUNNER_PATH, json.dumps(settings)]
        async with self._slot():
            start = time.monotonic()
            try:
                outcome = await run_sandboxed(argv, code, _sandbox_env(scratch), float(self.cfg.timeout_s),
                                              4 * int(self.cfg.max_output_chars))
            except OSError as exc:
                logger.error("python tool: cannot start the sandbox: %s", exc)
                return ToolResult(error=True, text=f"sandbox error: could not start the sandbox ({exc})")
            wall = time.monotonic() - start
        cause = describe_exit(outcome, asdict(self.cfg))
        body = outcome.stdout + ("\n" if outcome.stdout and not outcome.stdout.endswith("\n") else "") + outcome.stderr
        shown = _truncate(body.rstrip("\n"), int(self.cfg.max_output_chars), outcome.omitted_chars)
        text = f"error: {cause}" + (f"\n{shown}" if shown else "") if cause else (shown or "(no output)")
        metrics = {"tool/python_wall_s": wall, "tool/python_error": float(cause is not None),
                   "tool/python_timeout": float(outcome.timed_out),
                   "tool/python_output_chars": float(len(body) + outcome.omitted_chars)}
        return ToolResult(text=text, error=cause is not None, metrics=metrics)

    async def release(self, instance_id: str) -> None:
        entry = self._scratch.pop(instance_id, None)
        if entry is not None:
            await asyncio.to_thread(_remove_tree, entry[0])


def _truncate(body: str, limit: int, omitted_before: int) -> str:
    """Keep the first two thirds and the last third of `limit` characters (tracebacks end the output)."""
    if len(body) <= limit:
        return body
    head = limit * 2 // 3
    omitted = len(body) - limit + omitted_before
    return body[:head] + f"\n[... output truncated: about {omitted} characters omitted ...]\n" + body[-(limit - head):]


def _remove_tree(path: str) -> None:
    """Remove a scratch tree, even the parts the code made unreadable to its owner."""
    def retry(func, p, _exc):
        try:
            os.chmod(os.path.dirname(p), 0o700)
            os.chmod(p, 0o700)
            func(p)
        except OSError as exc:
            logger.warning("python tool: could not remove %s: %s", p, exc)

    shutil.rmtree(path, onerror=retry)
