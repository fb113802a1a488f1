"""How the `python` tool confines its child: the isolation modes, and which one this machine
supports (probed once per process and interpreter, and logged once).

- `unshare` (preferred): util-linux `unshare` gives the runner new net, mount and pid
  namespaces (plus a user namespace when not root). The net namespace has only a loopback
  device, down, so even localhost is unreachable; protected dirs are hidden under empty
  tmpfs; every mount is read-only but the scratch dir; the pid namespace ends with the
  runner. Not root: a nested user namespace drops the capabilities. Root: the code runs
  as a throw-away uid, so RLIMIT_NPROC applies.
- `audit` (fallback, weaker): no namespaces. An audit hook in the child refuses sockets,
  opens under protected dirs, writes outside scratch, and new programs (exec, subprocess)
  and ctypes, which would escape it. Pure-Python code is held; native code (an extension
  module doing its own syscalls) is not. rlimits still apply; as root the throw-away uid
  is used when the interpreter and scratch are reachable by other users, else the code
  keeps root's uid, which RLIMIT_NPROC does not limit, and the hook refuses fork too.

The audit hook runs in both modes as a second layer.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import secrets
import shutil
import subprocess
import tempfile
from dataclasses import dataclass

from async_rl.agent.tools.sandbox_process import RUNNER_PATH
from async_rl.agent.tools.sandbox_runner import closed_ancestor

logger = logging.getLogger(__name__)

UID_RANGE = (1_000_000_000, 2_000_000_000)  # throw-away uids: far from real users and subuid ranges


@dataclass(frozen=True, slots=True)
class Isolation:
    """One way to confine the runner."""

    name: str
    namespaces: bool  # net/mount/pid namespaces through util-linux `unshare`
    strict: bool  # the audit hook also refuses exec, subprocess and ctypes
    summary: str

    def prefix(self) -> list[str]:
        """The command that starts the runner in this mode (before the interpreter)."""
        if not self.namespaces:
            return []
        user = ["--user", "--map-root-user"] if os.geteuid() != 0 else []
        return [shutil.which("unshare") or "unshare", *user, "--net", "--mount", "--pid", "--fork",
                "--kill-child", "--mount-proc", "--propagation", "private"]

    def runner_flags(self) -> dict[str, bool]:
        return {"namespaces": self.namespaces, "userns": self.namespaces and os.geteuid() != 0,
                "strict": self.strict}

    def drops_uid(self, needed: list[str]) -> bool:
        """Whether the code runs as a throw-away uid: only as root (RLIMIT_NPROC never limits root),
        and without a mount namespace only if that uid can still reach every `needed` directory
        (with one, the runner re-exposes them)."""
        return os.geteuid() == 0 and (self.namespaces or not any(closed_ancestor(p) for p in needed))


def new_uid() -> int:
    """A throw-away uid for one episode's code."""
    return UID_RANGE[0] + secrets.randbelow(UID_RANGE[1] - UID_RANGE[0])


ISOLATIONS: dict[str, Isolation] = {  # tried in this order by isolation: auto
    "unshare": Isolation("unshare", namespaces=True, strict=False,
                         summary="net+mount+pid namespaces (util-linux unshare), read-only file system but scratch, "
                                 "protected dirs hidden, rlimits, audit hook"),
    "audit": Isolation("audit", namespaces=False, strict=True,
                       summary="FALLBACK, weaker: no namespaces; an audit hook refuses sockets, protected reads, "
                               "writes outside scratch, exec/subprocess/ctypes; rlimits"),
}


@functools.lru_cache(maxsize=None)
def _python_paths(python: str) -> tuple[str, ...]:
    query = "import sys, json; print(json.dumps([sys.prefix, sys.base_prefix, sys.exec_prefix, *sys.path]))"
    try:  # asked of the interpreter as the runner starts it (-I), not of this process
        out = subprocess.run([python, "-I", "-c", query], capture_output=True, text=True, timeout=60, check=True)
    except (OSError, subprocess.SubprocessError) as exc:
        raise ValueError(f"python tool config: python {python!r} cannot be run ({exc})") from None
    found = json.loads(out.stdout)
    dirs = sorted({os.path.realpath(p) for p in found if p and os.path.isdir(p)})
    return tuple(d for d in dirs if not any(d != o and d.startswith(o.rstrip("/") + "/") for o in dirs))


def python_paths(python: str) -> list[str]:
    """The directories the interpreter reads from (prefixes and sys.path), outermost only."""
    return list(_python_paths(python))


def _probe(iso: Isolation, python: str) -> str | None:
    """Run trivial code in this mode; None when it works, else why not."""
    if iso.namespaces and not shutil.which("unshare"):
        return "util-linux `unshare` is not installed"
    with tempfile.TemporaryDirectory(prefix="async_rl_probe_") as tmp:
        os.chmod(tmp, 0o711)
        scratch, protected = os.path.join(tmp, "scratch"), os.path.join(tmp, "protected")
        os.mkdir(scratch, 0o700)
        os.mkdir(protected)
        uid = new_uid() if iso.drops_uid(python_paths(python)) else None
        if uid is not None:
            os.chown(scratch, uid, uid)
        settings = {"scratch": os.path.realpath(scratch), "protected": [os.path.realpath(protected)],
                    "expose": python_paths(python), "uid": uid, "cpu_s": 10, "memory_bytes": 2**30,
                    "file_bytes": 2**20, "max_processes": 16, **iso.runner_flags()}
        argv = [*iso.prefix(), python, "-I", "-B", RUNNER_PATH, json.dumps(settings)]
        try:
            done = subprocess.run(argv, input="import json, os\nprint('ok')\n", capture_output=True, text=True,
                                  timeout=60, env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"})
        except (OSError, subprocess.SubprocessError) as exc:
            return str(exc)
    if done.returncode == 0 and done.stdout.strip() == "ok":
        return None
    return f"exit status {done.returncode}: {(done.stderr.strip() or done.stdout.strip())[-300:]}"


@functools.lru_cache(maxsize=None)
def detect_isolation(choice: str, python: str) -> Isolation:
    """The isolation to use: `choice` if it works here, or for "auto" the first in ISOLATIONS that does."""
    if choice != "auto" and choice not in ISOLATIONS:
        raise ValueError(f"python tool config: isolation must be 'auto' or one of {sorted(ISOLATIONS)}, "
                         f"got {choice!r}")
    reasons = {}
    for name in (list(ISOLATIONS) if choice == "auto" else [choice]):
        iso = ISOLATIONS[name]
        why = _probe(iso, python)
        if why is None:
            log = logger.warning if iso.strict else logger.info
            log("python tool isolation: %s (%s)%s", name, iso.summary,
                "".join(f"; {n} unavailable: {r}" for n, r in reasons.items()))
            return iso
        reasons[name] = why
    raise ValueError("python tool: no isolation mode works on this machine: "
                     + "; ".join(f"{n}: {r}" for n, r in reasons.items()))
