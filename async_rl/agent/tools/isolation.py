"""How the `python` tool confines its child: the isolation modes, and which one this machine
supports (probed once per process and interpreter, and logged once). `isolation: auto` takes
the first of the two isolating modes that works, in this order, and fails closed: where
neither works the tool is refused with one line at start-up, never run unconfined:

- `bwrap`: bubblewrap, where installed, builds the child's world: the host file system
  read-only, the episode's scratch directory the one writable place, protected dirs under
  empty unreadable tmpfs, a minimal read-only /dev, its own /proc, and new net, pid, ipc and
  uts namespaces (the net namespace has only loopback, so the host's localhost is
  unreachable). As root every capability but setuid/setgid is dropped, and the runner uses
  those two to become a throw-away uid (so RLIMIT_NPROC applies); directories that uid could
  not enter are re-exposed by bubblewrap itself.
- `unshare`: util-linux `unshare` gives the runner new net, mount and pid namespaces (plus a
  user namespace when not root). The net namespace has only a loopback device, down; the
  runner itself hides protected dirs under empty tmpfs and remounts every mount read-only
  but the scratch dir; the pid namespace ends with the runner. Not root: a nested user
  namespace drops the capabilities. Root: the code runs as a throw-away uid.
- `audit`: NO isolation, only when the config names it (`isolation: audit`). No namespaces:
  an audit hook in the child refuses sockets, opens under protected dirs, writes outside
  scratch, and new programs (exec, subprocess) and ctypes. An audit hook is not a security
  boundary: pure-Python code is held, native code (an extension module doing its own
  syscalls, or a crafted object) is not. rlimits still apply; as root the throw-away uid
  is used when the interpreter and scratch are reachable by other users, else the code
  keeps root's uid, which RLIMIT_NPROC does not limit, and the hook refuses fork too.

The audit hook runs in every mode as a second layer, and rlimits (CPU, address space, file
size, processes) in every mode.
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
from pathlib import Path
from typing import Any

from async_rl.agent.tools.sandbox_process import RUNNER_PATH
from async_rl.agent.tools.sandbox_runner import closed_ancestor

logger = logging.getLogger(__name__)

UID_RANGE = (1_000_000_000, 2_000_000_000)  # throw-away uids: far from real users and subuid ranges


class Isolation:
    """No isolation (`isolation: audit`, by name only): the runner alone, held by its audit hook
    (strict) and rlimits."""

    name = "audit"
    program: str | None = None  # the executable the runner is started under (None: none)
    runner_mounts = False  # the runner itself hides dirs and makes mounts read-only (its own mount namespace)
    strict = True  # the audit hook also refuses exec, subprocess and ctypes
    summary = ("NO isolation (asked for by name): no namespaces; an audit hook, which is not a security boundary, "
               "refuses sockets, protected reads, writes outside scratch, exec/subprocess/ctypes; rlimits")

    @property
    def namespaces(self) -> bool:
        """Kernel namespaces confine the code (not only the audit hook): a child process is held too."""
        return self.program is not None

    def missing(self) -> str | None:
        """Why this mode cannot be used here before trying it (a program not installed), else None."""
        return f"`{self.program}` is not installed" if self.program and not shutil.which(self.program) else None

    def prefix(self, settings: dict[str, Any]) -> list[str]:
        """The command that starts the runner with these settings (before the interpreter)."""
        return []

    def runner_flags(self) -> dict[str, bool]:
        return {"namespaces": self.runner_mounts, "userns": self.namespaces and os.geteuid() != 0,
                "strict": self.strict}

    def drops_uid(self, needed: list[str]) -> bool:
        """Whether the code runs as a throw-away uid: only as root (RLIMIT_NPROC never limits root),
        and without a mount namespace only if that uid can still reach every `needed` directory
        (with one, the mode re-exposes them)."""
        return os.geteuid() == 0 and (self.namespaces or not any(closed_ancestor(p) for p in needed))


class UnshareIsolation(Isolation):
    name, program, runner_mounts, strict = "unshare", "unshare", True, False
    summary = ("net+mount+pid namespaces (util-linux unshare), read-only file system but scratch, protected dirs "
               "hidden, rlimits, audit hook")

    def prefix(self, settings: dict[str, Any]) -> list[str]:
        user = ["--user", "--map-root-user"] if os.geteuid() != 0 else []
        return [shutil.which("unshare") or "unshare", *user, "--net", "--mount", "--pid", "--fork", "--kill-child",
                "--mount-proc", "--propagation", "private"]


class BwrapIsolation(Isolation):
    name, program, runner_mounts, strict = "bwrap", "bwrap", False, False
    summary = ("bubblewrap: read-only host file system but scratch, protected dirs hidden, net+pid+ipc+uts "
               "namespaces, capabilities dropped, rlimits, audit hook")

    def prefix(self, settings: dict[str, Any]) -> list[str]:
        args = [shutil.which("bwrap") or "bwrap", "--ro-bind", "/", "/", "--dev", "/dev", "--remount-ro", "/dev",
                "--proc", "/proc", "--unshare-net", "--unshare-pid", "--unshare-ipc", "--unshare-uts",
                "--die-with-parent"]
        if os.geteuid() == 0:  # the runner needs setuid/setgid once, to become its throw-away uid
            args += ["--cap-drop", "ALL", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
        tops: list[str] = []
        if settings["uid"] is not None:  # the runner script must be reachable too: bwrap starts it as root
            tops, reach = self._reach([*settings["expose"], os.path.dirname(RUNNER_PATH)], settings["scratch"])
            args += reach
        args += ["--bind", settings["scratch"], settings["scratch"]]
        for d in settings["protected"]:  # after every bind: a bind's source is the host's, never hidden
            if os.path.isdir(d):
                args += ["--perms", "0000", "--tmpfs", d, "--remount-ro", d]
        return [*args, *(a for top in tops for a in ("--remount-ro", top))]  # once all mount points exist

    @staticmethod
    def _reach(expose: list[str], scratch: str) -> tuple[list[str], list[str]]:
        """A directory the throw-away uid could not enter becomes an empty tmpfs holding only what the
        code needs (the Python installation read-only, its scratch), with a path it may walk down.
        Returns those directories and the arguments that make them."""
        targets = [(p, closed_ancestor(p)) for p in expose if os.path.isdir(p)]
        targets.append((scratch, closed_ancestor(os.path.dirname(scratch))))
        targets = [(p, top) for p, top in targets if top]
        tops = sorted({top for _, top in targets})
        args: list[str] = []
        for top in tops:
            args += ["--perms", "0755", "--tmpfs", top]
        made: set[str] = set()
        for p, top in targets:
            d = top
            for part in Path(p).relative_to(top).parts[:-1]:  # bwrap would make these 0700: root's alone
                d = os.path.join(d, part)
                if d not in made:
                    made.add(d)
                    args += ["--perms", "0711", "--dir", d]
            if p != scratch:
                args += ["--ro-bind", p, p]
        return tops, args


ISOLATIONS: dict[str, Isolation] = {iso.name: iso for iso in (BwrapIsolation(), UnshareIsolation(), Isolation())}
AUTO = [name for name, iso in ISOLATIONS.items() if iso.namespaces]  # tried in this order by isolation: auto


def new_uid() -> int:
    """A throw-away uid for one episode's code."""
    return UID_RANGE[0] + secrets.randbelow(UID_RANGE[1] - UID_RANGE[0])


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
    if (why := iso.missing()) is not None:
        return why
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
        argv = [*iso.prefix(settings), python, "-I", "-B", RUNNER_PATH, json.dumps(settings)]
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
    """The isolation to use: `choice` if it works here, or for "auto" the first in AUTO that does.
    "auto" never ends in `audit` (no isolation): where no isolating mode works it is an error."""
    if choice != "auto" and choice not in ISOLATIONS:
        raise ValueError(f"python tool config: isolation must be 'auto' or one of {sorted(ISOLATIONS)}, "
                         f"got {choice!r}")
    reasons = {}
    for name in (AUTO if choice == "auto" else [choice]):
        iso = ISOLATIONS[name]
        why = _probe(iso, python)
        if why is None:
            log = logger.warning if not iso.namespaces else logger.info
            log("python tool isolation: %s (%s)%s", name, iso.summary,
                "".join(f"; {n} unavailable: {r}" for n, r in reasons.items()))
            return iso
        reasons[name] = why
    why = "; ".join(f"{n}: {r}" for n, r in reasons.items())
    if choice == "auto":
        raise ValueError(f"python tool refused: no isolation works on this machine ({why}); install bubblewrap or "
                         "allow unprivileged user namespaces, or set `isolation: audit` in its config to run model "
                         "code with NO isolation (an audit hook and rlimits only)")
    raise ValueError(f"python tool: isolation {choice!r} does not work on this machine ({why})")
